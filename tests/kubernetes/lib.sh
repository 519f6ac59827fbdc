# tests/kubernetes/lib.sh — what build, up, smoke and down share: the pinned versions, the
# folders, the names and addresses of the test bed, and a few helpers. Sourced, not run.
# The procedure and every measurement behind these values: ../shared/reference/kubernetes.md.
# shellcheck shell=bash

export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export DEBIAN_FRONTEND=noninteractive

# ---------------------------------------------------------------- pinned versions
# The newest full Kubernetes tree Debian has (trixie's and sid's packages build kubectl only).
K8S_SRC_VERSION=${DEMESNE_K8S_SRC_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}
K8S_UPSTREAM=v1.20.2
# containerd 1.7 from trixie: its CRI still serves v1alpha2, all kubelet 1.20 speaks (2.x does not)
CONTAINERD_VERSION=${DEMESNE_K8S_CONTAINERD_VERSION:-1.7.24~ds1-6+deb13u1}
# Debian's mirror; only its package servers are used (and loopback)
DEBIAN_MIRROR=${DEMESNE_K8S_MIRROR:-http://deb.debian.org/debian}

# ---------------------------------------------------------------- folders
# the cache: built binaries, unpacked runtime packages, the two images the bed makes itself
K8S_CACHE=${DEMESNE_K8S_CACHE:-/var/cache/demesne/kubernetes}
K8S_DIR=$K8S_CACHE/$K8S_SRC_VERSION
K8S_BIN=$K8S_DIR/bin            # kube-apiserver, kubelet, kube-controller-manager
K8S_ROOT=$K8S_DIR/root          # dpkg -x of etcd, CNI plugins, busybox, containerd 1.7
K8S_IMAGES=$K8S_DIR/images      # pause.tar, busybox.tar (docker-archive format)
K8S_BUILD=$K8S_DIR/build        # the source tree, Go and GOCACHE while building
# the running bed: everything up makes lives here, and down removes it
K8S_STATE=${DEMESNE_K8S_STATE:-/var/lib/demesne/kubernetes}
K8S_KUBECONFIG=$K8S_STATE/admin.kubeconfig
K8S_SOCK=$K8S_STATE/run/containerd.sock

# ---------------------------------------------------------------- names and addresses
# 10.213.0.0/16: no route of these machines covers it (Podman uses 10.88/16, Docker 172.17/16)
K8S_NET=10.213.0.0/16
K8S_NODE=demesne-node
K8S_NODE_LINK=demesne-k8s0      # an empty bridge holding the node address (no dummy driver here)
K8S_NODE_IP=10.213.255.1
K8S_POD_BRIDGE=demesne-k8sbr    # the CNI bridge; no default route in the pods, no masquerade
K8S_POD_SUBNET=10.213.0.0/24
K8S_POD_GW=10.213.0.1
K8S_SERVICE_RANGE=10.213.128.0/24
K8S_SERVICE_IP=10.213.128.1
K8S_API_PORT=16443
K8S_ETCD_PORT=23790
K8S_ETCD_PEER_PORT=23800
K8S_KUBELET_PORT=10250
K8S_KUBELET_HEALTHZ_PORT=10248
K8S_KCM_PORT=10257
K8S_STREAM_PORT=10010           # containerd's CRI streaming server (exec, attach), on 127.0.0.1
K8S_PAUSE_IMAGE=localhost/pause:demesne
K8S_BUSYBOX_IMAGE=localhost/busybox:demesne
# sysctls the kubelet (vm.*, kernel.*) and the CNI bridge plugin (ip_forward) may rewrite
K8S_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward)
# fixed host paths kubelet 1.20 and libcni write to, whatever their configuration says (the
# kubelet's device plugin socket is always /var/lib/kubelet/device-plugins/kubelet.sock)
K8S_HOST_DIRS=(/var/log/pods /var/log/containers /var/lib/cni /var/lib/cni/results
  /var/lib/kubelet /usr/libexec/kubernetes)
K8S_CNI_NETWORK=demesne-test-bed  # the conflist's name: libcni's cache files start with it

# ---------------------------------------------------------------- helpers
k8s_name=${0##*/}
say() { echo "kubernetes/$k8s_name: $*"; }
die() { echo "kubernetes/$k8s_name: ERROR: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "must run as root"; }

# seconds since the epoch, with milliseconds
now() { date +%s.%N | cut -c1-14; }
# elapsed START -> "12.3"
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# pid_of NAME -> the pid of the bed's process NAME when it still runs
pid_of() {
  local f=$K8S_STATE/pid/$1 pid
  [ -r "$f" ] || return 1
  pid=$(cat "$f")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  echo "$pid"
}

# api METHOD PATH [curl args...]: the API server as the admin of the bed, with the
# kubeconfig's certificates (written by up under $K8S_STATE/pki)
api() {
  local method=$1 path=$2
  shift 2
  curl -sS --max-time 30 --cacert "$K8S_STATE/pki/ca.crt" --cert "$K8S_STATE/pki/admin.crt" \
    --key "$K8S_STATE/pki/admin.key" -X "$method" "$@" "https://127.0.0.1:$K8S_API_PORT$path"
}

ctr_bed() { "$K8S_ROOT/usr/bin/ctr" --address "$K8S_SOCK" --namespace k8s.io "$@"; }

-- The sandbox lifecycle over an engine adapter, as one face for the tools and jobs: every
-- name below is defined in one of the files of this folder, each of one concern:
--
--   owner.lua       which server process owns a sandbox, and whether it still runs
--   plan.lua        a sandbox's plan as a declared value (SandboxPlan): its fields, records
--   run.lua         a running sandbox's live state (SandboxRun): container id, proxy, exit
--   spec.lua        a sandbox's plan: settings checked, folders, claim, the neutral spec
--   delivery.lua    how a one-shot's command reaches demesne-init: control, exec, argv
--   files.lua       what the host reads and removes of a sandbox's files (status, logs)
--   oneshot.lua     one-shot runs (sandbox_script)
--   persistent.lua  persistent sandboxes: create, look up, renew, expire, destroy, list
--   exec.lua        commands in a persistent sandbox through demesne-init (sandbox_exec)
--   transfer.lua    sandbox_upload and sandbox_download
--   quota.lua       the output quota: a watcher of each running sandbox's /out
--   reaper.lua      removes expired sandboxes and what a server that is gone left behind
--   repository.lua  a host repository in a persistent sandbox: clone after create, hand back
--   snapshots.lua   snapshot images: labels, lookup, list, restore into a new sandbox
--   snapshot.lua    sandbox_snapshot, sandbox_fork, sandbox_pause and their kin
--
-- Host layout (DESIGN.md "State on the host"):
--   <output_root>/<run id>/              = /out of that sandbox (stdout.log, stderr.log, exec/<n>/…)
--   <state_dir>/run/<run id>/            = /.demesne/run (exec records written by demesne-init)
--   <state_dir>/expiry/<run id>          = renewed expiry (labels are immutable; kept outside
--                                          the run folder, which the sandbox can write)
--   <state_dir>/claims/<run id>          = {engine, owner} of the run folder, for the reaper
--                                          (also outside the sandbox's reach)
local exec = require("demesne.sandbox.exec")
local files = require("demesne.sandbox.files")
local oneshot = require("demesne.sandbox.oneshot")
local owner = require("demesne.sandbox.owner")
local persistent = require("demesne.sandbox.persistent")
local preview = require("demesne.sandbox.preview")
local reaper = require("demesne.sandbox.reaper")
local repository = require("demesne.sandbox.repository")
local snapshot = require("demesne.sandbox.snapshot")
local spec = require("demesne.sandbox.spec")
local transfer = require("demesne.sandbox.transfer")

local sandbox = {}

--- The isolation levels a sandbox call may ask for (the `isolation` parameter).
sandbox.ISOLATIONS = spec.ISOLATIONS

local function export(from, names)
  for name in names:gmatch("%S+") do
    sandbox[name] = assert(from[name], name)
  end
end

export(owner, "owner owner_alive")
export(spec, "new_run_id engine num limits env check_command timeout dirs prepare default_env make_dirs deadline_ms")
export(spec, "isolation check_inputs_reach private_roots")
export(files, "oom_note gvisor_kill_note check_status read_status collect remove_in remove_tree")
export(oneshot, "script_prepare script_env script_start script_send script_remove script_wait script_result run_script")
export(oneshot, "script_teardown use_pool watch_quota quota_outcome script_stop_gently")
export(persistent, "create write_expiry expiry_file lookup state_of check_alive stop_unresponsive destroy list expose expose_run")
export(persistent, "watch unwatch unwatch_all watched stopped_reason expiry_of")
--- The port previews this server holds for the sandbox `run_id`: [{port, url}] (lua/sandbox/preview.lua).
sandbox.previews = preview.list
export(exec, "exec_prepare exec_run exec_kill exec_result exec")
export(transfer, "upload download")
export(reaper, "reap start_exit_reaper after_exit")
-- a persistent sandbox's repository (lua/sandbox/repository.lua) wraps create, exec, destroy
export(repository, "create exec destroy")
sandbox.hand_back = repository.hand_back

--- Snapshots, forks and pause (lua/sandbox/snapshot.lua).
sandbox.snapshot, sandbox.snapshots, sandbox.snapshot_delete = snapshot.take, snapshot.list, snapshot.delete
sandbox.fork, sandbox.pause, sandbox.resume = snapshot.fork, snapshot.pause, snapshot.resume
sandbox.snapshot_prune, sandbox.check_fork_count = snapshot.prune, snapshot.check_count

return sandbox

/* Fuzz harness: the egress proxy's DNS answer decoder (core/dns.c), used in test mode
 * (egress_resolver) where a DNS server on loopback answers for the test hosts; and the
 * query encoder, fed with the same bytes as a name. The answer's own id is the one asked,
 * so decoding goes past the header. Findings: ASan/UBSan, more addresses than asked for,
 * an address that is not IPv4, a query that does not fit or does not start with its id. */
#include "fuzz.h"
#include "dns.h"
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct sockaddr_in out[DM_DNS_MAX_ADDRS];
  unsigned id = size >= 2 ? ((unsigned)data[0] << 8 | data[1]) : 0;
  int n = dm_dns_decode_answer(data, size, id, out, DM_DNS_MAX_ADDRS);
  FUZZ_CHECK(n <= DM_DNS_MAX_ADDRS, "%d addresses", n);
  for (int i = 0; i < n; i++) FUZZ_CHECK(out[i].sin_family == AF_INET, "address %d is not IPv4", i);

  char name[300];
  size_t len = size < sizeof name - 1 ? size : sizeof name - 1;
  memcpy(name, data, len);
  name[len] = '\0';
  unsigned char q[512];
  size_t qn = dm_dns_encode_query(name, 0xbeef, q, sizeof q);
  FUZZ_CHECK(qn == 0 || (qn >= 12 + 2 + 4 && qn <= sizeof q && q[0] == 0xbe && q[1] == 0xef), "query of %zu bytes", qn);
  return 0;
}

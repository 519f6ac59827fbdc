/* Shared bits of the C harnesses in tests/fuzz: a check that aborts (so libFuzzer keeps
 * the input as a crash) and a deterministic splitter that cuts an input into the read
 * sizes a socket might deliver, so seeds stay plain bytes (a request head, a tar). */
#ifndef DEMESNE_FUZZ_H
#define DEMESNE_FUZZ_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/// Aborts with a message when `cond` is false: a broken invariant is a finding.
#define FUZZ_CHECK(cond, ...)                                                        \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "fuzz: %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                  \
      fputc('\n', stderr);                                                           \
      abort();                                                                       \
    }                                                                                \
  } while (0)

/// Read sizes for one input: a generator seeded from the input's bytes (FNV-1a), so the
/// same input always splits the same way and a mutation may change the split.
typedef struct fuzz_chunks {
  uint64_t state;
} fuzz_chunks;

static inline void fuzz_chunks_init(fuzz_chunks *c, const uint8_t *data, size_t size) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < size; i++) h = (h ^ data[i]) * 1099511628211ull;
  c->state = h | 1;
}

/// The next read size, 1..max (max >= 1): mostly small reads, sometimes all that is left.
static inline size_t fuzz_chunk_next(fuzz_chunks *c, size_t max) {
  c->state ^= c->state << 13;
  c->state ^= c->state >> 7;
  c->state ^= c->state << 17;
  unsigned pick = (unsigned)(c->state >> 56);
  if (pick < 64) return max;                    /* one read takes the rest */
  size_t n = 1 + (size_t)(c->state % (pick < 192 ? 16 : 512));
  return n < max ? n : max;
}

#endif

/* The check of the plain C unit tests (tests/c/test_*.c): CHECK(cond, fmt, ...) counts a
 * failed condition in `failures` and prints it with its file, line and message; the test's
 * main returns non-zero when `failures` is. One copy per test executable (static). */
#ifndef DEMESNE_TESTS_CHECK_H
#define DEMESNE_TESTS_CHECK_H
#include <stdio.h>

static int failures;
#define CHECK(cond, ...) \
  do { \
    if (!(cond)) { \
      failures++; \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__); \
      fputc('\n', stderr); \
    } \
  } while (0)

#endif

// doctest's runner and main, compiled once for all CPU tests: its implementation costs more
// to compile than any test (over a minute under the sanitizers), so no test compiles it again.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

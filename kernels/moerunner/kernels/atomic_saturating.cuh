// Device code: a status counter that saturates instead of wrapping, for the words the GPU
// backends report into caller-owned status structs (moe_status, ep_status).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/atomic_saturating.cuh needs nvcc: include it from a .cu file"
#endif

#include <climits>
#include <cstdint>

namespace moerunner::kernels {

// *word += value (value >= 0), saturating at INT_MAX; returns the value before the addition.
__device__ inline int atomic_add_saturating(int* word, long long value) {
  int before = 0;  // a guess; the CAS returns the true value when it is wrong
  for (;;) {
    const long long sum = static_cast<long long>(before) + value;
    const int after = sum > INT_MAX ? INT_MAX : static_cast<int>(sum);
    const int seen = atomicCAS(word, before, after);
    if (seen == before) return before;
    before = seen;
  }
}

}  // namespace moerunner::kernels

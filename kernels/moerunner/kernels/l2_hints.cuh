// PTX wrappers for L2 residency: a cache policy for data read once, the 16-byte cp.async that
// carries it (and may ask for the 256-byte block around it), and a prefetch of a byte range
// into L2 that holds no registers or shared memory (a bulk prefetch on sm_90, one prefetch per
// 128-byte line on older parts).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/l2_hints.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

namespace moerunner::kernels {

// The L2 policy of a load: its lines the first to be replaced, or left as they are (sm_80+).
__device__ __forceinline__ std::uint64_t l2_load_policy(bool evict_first) {
  std::uint64_t policy;
  if (evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  else asm volatile("createpolicy.fractional.L2::evict_unchanged.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// cp_async_16 (kernel_grouped_gemm.cuh) with an L2 policy, and with Fetch256 a hint that L2
// fetch the whole 256-byte block around the 16 bytes.
template <bool Fetch256>
__device__ __forceinline__ void cp_async_16_hinted(std::uint32_t dst, const void* src, bool valid,
                                                   std::uint64_t policy) {
  const int src_bytes = valid ? 16 : 0;
  if constexpr (Fetch256)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(policy)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(policy)
                 : "memory");
}

// cp_async_16 with only the hint that L2 fetch the whole 256-byte block around the 16 bytes (no
// policy).
__device__ __forceinline__ void cp_async_16_fetch_256(std::uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// Asks L2 for `bytes` at `p` (16-byte aligned, a multiple of 16) and returns at once.
__device__ __forceinline__ void prefetch_l2(const void* p, std::uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#else
  const char* c = static_cast<const char*>(p);
  for (std::uint32_t off = 0; off < bytes; off += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(c + off));
#endif
}

}  // namespace moerunner::kernels

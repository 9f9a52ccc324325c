// Flags between the CTAs of one grid, for kernels whose later work items wait on earlier ones
// (the fused decode GEMMs): a CTA publishes what its threads wrote by a release add after a
// barrier, a waiter spins on an acquire load. Sound only when every CTA that must arrive can be
// resident while the waiters spin: persistent grids no larger than the device holds, where
// no CTA waits on work that a CTA behind it in its own sequence would do.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/grid_sync.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

namespace moerunner::kernels {

// After a barrier of the CTA, by one thread: makes the CTA's writes before the barrier
// visible to any thread that acquires the counter and reads its new value.
__device__ __forceinline__ void release_add(std::int32_t* counter, std::int32_t v) {
  asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "r"(v) : "memory");
}

__device__ __forceinline__ std::int32_t acquire_load(const std::int32_t* counter) {
  std::int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// Spins until *counter >= target; what the arrivals published is then visible to this thread
// (and, after a barrier, to the threads it synchronizes with).
__device__ __forceinline__ void wait_at_least(const std::int32_t* counter, std::int32_t target) {
  while (acquire_load(counter) < target) __nanosleep(64);
}

}  // namespace moerunner::kernels

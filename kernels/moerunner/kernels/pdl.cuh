// Programmatic dependent launch, device side (sm_90+; no-ops on older architectures and in a
// grid that was launched without the programmatic-serialization attribute).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/pdl.cuh needs nvcc: include it from a .cu file"
#endif

namespace moerunner::kernels {

// Waits until the grids this one depends on have finished and their writes are visible.
// Every thread that reads what they wrote must call it first.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the grid launched after this one start its CTAs now (set-up that reads nothing of
// ours); they still wait for this grid to finish before reading its output.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace moerunner::kernels

// Host side of programmatic dependent launch: launches a kernel whose CTAs may start while
// the previous kernel on the stream is still running (that kernel lets them with
// kernels::allow_dependent_grids, or by finishing). The kernel must call
// kernels::wait_for_prior_grids before it reads anything the stream produced before it.
// Works inside stream capture (the graph gets a programmatic edge).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/pdl_launch.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "moerunner/gpu/cuda_check.hpp"

namespace moerunner::gpu {

template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace moerunner::gpu

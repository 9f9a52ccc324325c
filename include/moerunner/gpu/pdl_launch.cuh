// Host side of programmatic dependent launch: launches a kernel whose CTAs may start while
// the previous kernel on the stream is still running (that kernel lets them with
// kernels::allow_dependent_grids, or by finishing). The kernel must call
// kernels::wait_for_prior_grids before it reads anything the stream produced before it.
// Works inside stream capture (the graph gets a programmatic edge). Also launches in
// thread-block clusters (launch_dependent_clusters).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/pdl_launch.cuh needs nvcc: include it from a .cu file"
#endif

#include <array>
#include <atomic>
#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "moerunner/gpu/cuda_check.hpp"

namespace moerunner::gpu {

// Whether the current device has programmatic dependent launch (compute capability 9.0+),
// cached per device; older devices get plain launches.
inline bool device_has_pdl() {
  constexpr int cached_devices = 64;
  static std::array<std::atomic<int>, cached_devices> cache{};  // 0 unknown, 1 no, 2 yes
  int device = 0, major = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 0 && device < cached_devices) {
    if (const int c = cache[device].load(std::memory_order_relaxed); c > 0) return c == 2;
  }
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (device >= 0 && device < cached_devices) cache[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

// The launch configuration with its attributes: programmatic serialization when `dependent`
// and the device has it, and clusters of cluster_x CTAs along x when cluster_x > 1.
struct launch_config {
  cudaLaunchConfig_t config{};
  std::array<cudaLaunchAttribute, 2> attrs{};

  launch_config(dim3 grid, dim3 block, std::size_t smem_bytes, cudaStream_t stream, bool dependent,
                unsigned cluster_x = 1) {
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    unsigned n = 0;
    if (dependent && device_has_pdl()) {
      attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    if (cluster_x > 1) {
      attrs[n].id = cudaLaunchAttributeClusterDimension;
      attrs[n].val.clusterDim.x = cluster_x;
      attrs[n].val.clusterDim.y = 1;
      attrs[n].val.clusterDim.z = 1;
      ++n;
    }
    config.attrs = attrs.data();
    config.numAttrs = n;
  }
  launch_config(const launch_config&) = delete;  // config.attrs points into this object
  launch_config& operator=(const launch_config&) = delete;
};

// As launch_dependent, in clusters of cluster_x CTAs along x (the grid a multiple of it);
// cluster_x 1 launches no clusters.
template <class... Params, class... Args>
void launch_dependent_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                               cudaStream_t stream, bool dependent, unsigned cluster_x, Args&&... args) {
  const launch_config c(grid, block, smem_bytes, stream, dependent, cluster_x);
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&c.config, kernel, std::forward<Args>(args)...));
}

// `dependent` false makes it a plain launch.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes, cudaStream_t stream,
                      bool dependent, Args&&... args) {
  launch_dependent_clusters(kernel, grid, block, smem_bytes, stream, dependent, 1u, std::forward<Args>(args)...);
}

}  // namespace moerunner::gpu

// Where a CTA of a wgmma grouped GEMM works when CTAs run in clusters along M: its rank, the
// cluster's first work item and the stride between them, and its rows of a schedule tile that
// spans the cluster. Shared by the 16-bit and fp8 wgmma kernels (sm_90a).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_cluster_tiles.cuh needs nvcc: include it from a .cu file"
#endif

#include <cuda/ptx>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"

namespace moerunner::kernels {

// The CTA's place in its cluster and the cluster's in the grid; work items go to clusters.
struct cta_place {
  int rank;    // in the cluster
  int first;   // first work item: the cluster's index
  int stride;  // clusters in the grid
};

template <int Cluster>
__device__ __forceinline__ cta_place cluster_place() {
  if constexpr (Cluster == 1) {
    return {0, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)};
  } else {
    // Clusters span consecutive CTAs along x, rank = blockIdx.x % Cluster.
    return {static_cast<int>(cuda::ptx::get_sreg_cluster_ctarank()), static_cast<int>(blockIdx.x) / Cluster,
            static_cast<int>(gridDim.x) / Cluster};
  }
}

// This CTA's rows of schedule tile t: all of them, or in a cluster its BlockM-row part
// (possibly none: row_begin == row_end).
template <int Cluster, int BlockM>
__device__ __forceinline__ gpu::moe_m_tile cluster_cta_rows(const gpu::moe_m_tile& t, int rank) {
  if constexpr (Cluster == 1) {
    return t;
  } else {
    const int begin = t.row_end - t.row_begin > rank * BlockM ? t.row_begin + rank * BlockM : t.row_end;
    const int end = t.row_end - begin > BlockM ? begin + BlockM : t.row_end;
    return {t.expert, begin, end, 0};
  }
}

}  // namespace moerunner::kernels

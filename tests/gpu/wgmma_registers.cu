// Device code only (compiled to a cubin by the kernels suite's ptxas_spills test): every sm_90a
// wgmma GEMM the fused backends launch, for one 16-bit output type, with its work items in fixed
// turns and (16-bit, and fp8 64-row CTAs alone or in pairs with the plain K loop) handed out at run
// time, the fp8 GEMM2 and gated GEMM1 with store warps, and the narrow decode tiles (e4m3 and
// 16-bit). Their accumulators and the fp8 promotion's block live in registers under setmaxnreg
// budgets; a spill in the K loop or the epilogue costs what the tile was chosen to save, so none
// may spill; nor may ptxas serialize their wgmma (the overlapped and staggered fp8 K loops keep a
// group in flight across other code).
#include <cuda_bf16.h>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma.cuh"
#include "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_fp8.cuh"
#include "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_narrow.cuh"

namespace k = moerunner::kernels;
namespace g = moerunner::gpu;
using bf16 = __nv_bfloat16;

#define MOERUNNER_WGMMA_16_AS(Policy, Kind, HandOut)                                                          \
  template __global__ void k::moe_grouped_gemm_wgmma_kernel<bf16, g::Policy, k::moe_gemm_kind::Kind, HandOut>( \
      const k::moe_gemm_params<bf16>, const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap);
#define MOERUNNER_WGMMA_16(Policy, Kind)      \
  MOERUNNER_WGMMA_16_AS(Policy, Kind, false) \
  MOERUNNER_WGMMA_16_AS(Policy, Kind, true)
#define MOERUNNER_WGMMA_FP8_KERNEL(Kind, Cluster, BlockM, Loop, HandOut, Staged)                            \
  template __global__ void k::moe_grouped_gemm_wgmma_fp8_kernel<bf16, k::moe_gemm_kind::Kind, Cluster, BlockM, \
                                                               g::fp8_k_loop::Loop, HandOut, Staged>(        \
      const k::moe_gemm_fp8_params<bf16>, const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap);
#define MOERUNNER_WGMMA_FP8_AS(Kind, Cluster, BlockM, Loop, HandOut) \
  MOERUNNER_WGMMA_FP8_KERNEL(Kind, Cluster, BlockM, Loop, HandOut, false)
#define MOERUNNER_WGMMA_FP8(Kind, Cluster, BlockM, Loop) MOERUNNER_WGMMA_FP8_AS(Kind, Cluster, BlockM, Loop, false)
#define MOERUNNER_WGMMA_NARROW(Kind, N, Fp8)                                                               \
  template __global__ void k::moe_grouped_gemm_wgmma_narrow_kernel<bf16, k::moe_gemm_kind::Kind, N, Fp8>( \
      const k::narrow_params<bf16, Fp8>, const __grid_constant__ CUtensorMap);
#define MOERUNNER_WGMMA_NARROW_ALL(Kind, Fp8) \
  MOERUNNER_WGMMA_NARROW(Kind, 8, Fp8)        \
  MOERUNNER_WGMMA_NARROW(Kind, 16, Fp8)       \
  MOERUNNER_WGMMA_NARROW(Kind, 32, Fp8)
#define MOERUNNER_WGMMA_FP8_HANDED_OUT(Kind, Cluster, BlockM) \
  MOERUNNER_WGMMA_FP8_AS(Kind, Cluster, BlockM, plain, false)  \
  MOERUNNER_WGMMA_FP8_AS(Kind, Cluster, BlockM, plain, true)

MOERUNNER_WGMMA_16(sm90_wgmma_gemm_policy, gate_up)
MOERUNNER_WGMMA_16(sm90_wgmma_gemm_policy, up_only)
MOERUNNER_WGMMA_16(sm90_wgmma_gemm_policy, down)
MOERUNNER_WGMMA_16(sm90_wgmma_m128x2_gemm_policy, gate_up)
MOERUNNER_WGMMA_16(sm90_wgmma_m128x2_gemm_policy, up_only)
MOERUNNER_WGMMA_16(sm90_wgmma_m128x2_gemm_policy, down)
MOERUNNER_WGMMA_16(sm90_wgmma_m64_gemm_policy, gate_up)
MOERUNNER_WGMMA_16(sm90_wgmma_m64_gemm_policy, up_only)
MOERUNNER_WGMMA_16(sm90_wgmma_m64_gemm_policy, down)
MOERUNNER_WGMMA_16(sm90_wgmma_m64n128_gemm_policy, gate_up)
MOERUNNER_WGMMA_16(sm90_wgmma_m64n128_gemm_policy, up_only)
MOERUNNER_WGMMA_16(sm90_wgmma_m64n128_gemm_policy, down)
MOERUNNER_WGMMA_FP8_HANDED_OUT(gate_up, 1, g::fp8_block_m)
MOERUNNER_WGMMA_FP8_HANDED_OUT(up_only, 1, g::fp8_block_m)
MOERUNNER_WGMMA_FP8_HANDED_OUT(down, 1, g::fp8_block_m)
MOERUNNER_WGMMA_FP8_HANDED_OUT(gate_up, 2, g::fp8_block_m)
MOERUNNER_WGMMA_FP8_HANDED_OUT(up_only, 2, g::fp8_block_m)
MOERUNNER_WGMMA_FP8_HANDED_OUT(down, 2, g::fp8_block_m)
MOERUNNER_WGMMA_FP8(gate_up, 4, g::fp8_block_m, plain)
MOERUNNER_WGMMA_FP8(up_only, 4, g::fp8_block_m, plain)
MOERUNNER_WGMMA_FP8(down, 4, g::fp8_block_m, plain)
MOERUNNER_WGMMA_FP8(gate_up, 1, g::fp8_large_block_m, plain)
MOERUNNER_WGMMA_FP8(up_only, 1, g::fp8_large_block_m, plain)
MOERUNNER_WGMMA_FP8(down, 1, g::fp8_large_block_m, plain)
MOERUNNER_WGMMA_FP8(gate_up, 1, g::fp8_block_m, overlap)
MOERUNNER_WGMMA_FP8(up_only, 1, g::fp8_block_m, overlap)
MOERUNNER_WGMMA_FP8(down, 1, g::fp8_block_m, overlap)
MOERUNNER_WGMMA_FP8(gate_up, 2, g::fp8_block_m, overlap)
MOERUNNER_WGMMA_FP8(up_only, 2, g::fp8_block_m, overlap)
MOERUNNER_WGMMA_FP8(down, 2, g::fp8_block_m, overlap)
MOERUNNER_WGMMA_FP8(gate_up, 1, g::fp8_block_m, stagger)
MOERUNNER_WGMMA_FP8(up_only, 1, g::fp8_block_m, stagger)
MOERUNNER_WGMMA_FP8(down, 1, g::fp8_block_m, stagger)
MOERUNNER_WGMMA_FP8(gate_up, 2, g::fp8_block_m, stagger)
MOERUNNER_WGMMA_FP8(up_only, 2, g::fp8_block_m, stagger)
MOERUNNER_WGMMA_FP8(down, 2, g::fp8_block_m, stagger)
MOERUNNER_WGMMA_FP8_KERNEL(down, 1, g::fp8_block_m, plain, false, true)
MOERUNNER_WGMMA_FP8_KERNEL(down, 2, g::fp8_block_m, plain, false, true)
MOERUNNER_WGMMA_FP8_KERNEL(gate_up, 1, g::fp8_block_m, plain, false, true)
MOERUNNER_WGMMA_FP8_KERNEL(gate_up, 2, g::fp8_block_m, plain, false, true)
MOERUNNER_WGMMA_NARROW_ALL(gate_up, true)
MOERUNNER_WGMMA_NARROW_ALL(up_only, true)
MOERUNNER_WGMMA_NARROW_ALL(down, true)
MOERUNNER_WGMMA_NARROW_ALL(gate_up, false)
MOERUNNER_WGMMA_NARROW_ALL(up_only, false)
MOERUNNER_WGMMA_NARROW_ALL(down, false)

// moe_bench: every built-in GPU backend on the MoE shapes of three real models, beside
// the ceilings of the GPU it runs on, measured in the same process.
//
//   moe_bench --out results.jsonl --commit $(git rev-parse --short HEAD)
//             [--shapes Mixtral-8x7B,DeepSeek-V3,Qwen3-30B-A3B,NAME:E:K:H:I] [--tokens 1,8,64,512,4096,16384]
//             [--backends cuda_fused,cublas_grouped,cuda_fused_det,...] [--once]
//
// Rows: every built-in GPU backend with its defaults, plus variants of cuda_fused:
// cuda_fused_det (deterministic = true: GEMM2 writes rows, combine sums them in slot order;
// in the default list), cuda_fused_batch_invariant (batch_invariant = true: a token's bits
// independent of the batch; in the default list), and on request cuda_fused_mma (the mma.sync sm90 tuning forced on
// sm_90a code), cuda_fused_m64 / cuda_fused_m64n128 / cuda_fused_m128 (the wgmma kernels with
// 64 x 256, 64 x 128 or 128 x 256 tiles forced, where the default picks by shape),
// cuda_fused_m128x2 (128-row tiles in 2-CTA clusters forced), cuda_fused_stream (the stream
// GEMMs forced, which the default picks at decode), cuda_fused_stream_ordered (their form with
// K in order, one warp per CTA), cuda_fused_band1, _band2 and _band4 (raster bands of 1, 2 and
// 4 M tiles where the default is 8; band 1 walks the N tiles fastest) and
// cuda_fused_pdl / cuda_fused_nopdl (programmatic dependent launches on / off everywhere; by
// default on with the stream GEMMs only) and cuda_fused_plankernel (the plan kernel at decode,
// where by default the stream GEMMs build the schedule themselves: set_plan_in_gemms),
// and the stream GEMMs' use of L2 (set_stream_l2): cuda_fused_prefetch (GEMM1 asks L2 for up
// to half of it of GEMM2's first weights after its own first copies), cuda_fused_prefetch_end
// (the same once GEMM1's CTAs have issued their last copies), cuda_fused_l2plain (weight copies
// neither evict-first nor 256-byte), cuda_fused_nofetch256 (never 256-byte) and
// cuda_fused_fetch256 (always 256-byte), which measure one choice each; and of cuda_fused_fp8,
// on request: cuda_fused_fp8_wgmma (single wgmma CTAs at every M: neither the stream GEMMs nor
// pairs), cuda_fused_fp8_single (never pairs of CTAs), cuda_fused_fp8_pairs (pairs of CTAs
// wherever the stream GEMMs are not taken), cuda_fused_fp8_stream (the stream GEMMs at every
// M; slow at prefill: ask for decode cells), cuda_fused_fp8_m64 (64-row CTAs alone wherever the
// stream GEMMs are not taken), cuda_fused_fp8_m128 (128-row CTAs there), cuda_fused_fp8_plain,
// cuda_fused_fp8_overlap and cuda_fused_fp8_stagger (each K loop forced, gpu::fp8_k_loop), the same
// in pairs of CTAs (cuda_fused_fp8_pairs_overlap, cuda_fused_fp8_pairs_stagger),
// cuda_fused_fp8_band16 and cuda_fused_fp8_overlap_band16 (raster bands of 16 M tiles, not 8),
// cuda_fused_fp8_quads (fours of CTAs on 256-row tiles wherever the stream GEMMs are not taken),
// cuda_fused_fp8_down_split3 (the wgmma GEMM2's K in 3 splits wherever the plan may split it),
// cuda_fused_fp8_det (deterministic: GEMM2 writes rows that the combine kernel sums),
// cuda_fused_fp8_rows and cuda_fused_fp8_reduce (GEMM2's rows for the combine kernel, or its
// reductions into the output, forced wherever the run may take either); cuda_fused_down_cp_async and
// cuda_fused_fp8_down_cp_async (the wgmma GEMM2's A rows by the producer's cp.async, not by TMA),
// cuda_fused_fp8_staged (the wgmma GEMM2's sums stored by store warps wherever it may, and GEMM1's
// plain K loop: against cuda_fused_fp8_plain), cuda_fused_fp8_direct (GEMM2's consumers store
// their own sums where the plan takes store warps), cuda_fused_fp8_dependent (the wgmma
// GEMMs launched as programmatic dependents, loading their first weight tiles before their wait),
// cuda_fused_fp8_up_split2 and _up_split3 (the wgmma GEMM1 in 2 or 3 K splits where it may,
// finished by a kernel of its own), cuda_fused_fp8_staged_up (the gated wgmma GEMM1's act
// quantized and stored by store warps wherever it may, on the plain K loop), cuda_fused_fp8_narrow
// and cuda_fused_narrow (the narrow decode tiles, weights as the wgmma's M and 8-32 tokens as its
// N, at every M: the stream GEMMs off; cuda_fused_narrow_pdl with programmatic dependent
// launches), cuda_fused_fp8_wide (the narrow tiles off: the plan before them),
// cuda_fused_fp8_local_plan (the narrow tiles ordering the rows themselves up to 64 slots, no
// plan kernel; cuda_fused_narrow does by default), cuda_fused_narrow32 and cuda_fused_fp8_narrow32
// (the narrow tiles at every M with 32 tokens per tile, whatever the average rows).
// With the wgmma GEMMs' work items handed out at run time (set_hand_out): cuda_fused_handed_out,
// cuda_fused_m128x2_handed_out, cuda_fused_fp8_handed_out, cuda_fused_fp8_single_handed_out and
// cuda_fused_fp8_pairs_handed_out, each the row of the same name without the suffix otherwise.
// With raster bands of one expert's M tiles each (set_expert_bands, gpu/expert_bands.hpp):
// cuda_fused_expert_bands and cuda_fused_fp8_expert_bands.
//
// What is timed: a runner's run() from topk_ids/topk_weights to the final [M, H] output
// (routing plan, both GEMMs, activation, combine), median over batches of launches timed
// with CUDA events; replayed from a CUDA graph when the policy is graph-capturable, else
// called directly (cublas_grouped synchronizes inside each run, so its time includes that
// round trip). Routing is timed apart from it, from graphs: routing_ms = gpu::topk from f32
// logits; route_plan_ms = topk + the routing plan and M-tile schedule cuda_fused builds, launched
// as it launches them (the plan a programmatic dependent of topk at decode; up to 64 slots no
// plan kernel runs, the stream GEMMs order the rows themselves, and it is topk alone); and
// for graph-capturable backends layer_ms = topk and the run in one graph (routing included).
// workspace_bytes is the runner's workspace query for the cell, plan its describe(M) (the kernels
// that ran).
//
// Ceilings, measured first: HBM read bandwidth (a vectorized read kernel over 4 GiB, far
// beyond the 60 MB L2), device copy bandwidth (cudaMemcpy device to device, read + write
// bytes), the cuBLAS bf16 GEMM rate at 8192^3 on random data, and the cuBLASLt e4m3 GEMM rate
// (f32 accumulate, bf16 out) at 8192^3 (fp8_TFLOPs).
//
// Per cell: flops = 6*M*k*H*I (gated; 4*M*k*H*I ungated); bytes = weights of the experts the
// routing actually touches + x in + out + topk ids and weights; floor_ms = max(bytes / read
// bandwidth, flops / GEMM rate); fraction_of_floor = floor_ms / ms. Rows of fp8 backends
// (cuda_fused_fp8: weights e4m3 with 128 x 128 block scales, quantized from the same bf16 weights;
// "weights": "fp8") count weights at 1 byte plus their scales and the e4m3 GEMM rate.
//
// Correctness per cell, max_rel_err = the largest per-token ||out_t - check_t|| / ||check_t||:
// for M <= 64 against the CPU reference backend on up to 3 tokens ("check": "reference_cpu"),
// above that against the first other GPU backend's full output ("check": "vs_<backend>"). Every
// cell also reports ref_rel_err, the same measure against the CPU reference on up to 3 tokens. A
// NaN or inf anywhere in the output makes max_rel_err null in the JSON and "NaN" in the table; a
// cell over 2e-2 on either measure counts as failed. fp8 rows are checked against the reference's
// fp8 path (the same quantization points) and compared in full only with another fp8 row; their
// bound is 3e-2.
//
// Small working sets would be timed out of L2: each cell rotates over several routing sets
// (different tokens, hence different experts), and over several weight copies when one copy
// of a shape's weights would fit in four times the L2.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include "moerunner/core/host_float.hpp"
#include "moerunner/gpu/cublas_check.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/routing.cuh"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cublas_grouped_policy.cuh"
#include "moerunner/policies/cuda_fused_fp8_policy.cuh"
#include "moerunner/policies/cuda_fused_policy.cuh"
#include "bench_util.hpp"

namespace mr = moerunner;

namespace {

using namespace bench_util;

// The GPU backends under test: a compile-time list, each picked by name through MoeRunner.
using bench_runner = mr::MoeRunner<mr::cuda_fused_policy, mr::cublas_grouped_policy, mr::cuda_fused_fp8_policy>;

// Rows of backends that take fp8 block-scaled weights (their names say fp8).
bool is_fp8_backend(std::string_view name) { return name.find("fp8") != std::string_view::npos; }

// A benchmark row that runs a built-in backend with non-default settings.
struct backend_variant {
  std::string_view label, backend;
  mr::gpu::gemm_tuning_choice tuning;
  bool deterministic;
  bool by_default;       // in the default list (else only through --backends)
  int raster_band = 0;   // cuda_fused: 0 = the tuning's; cuda_fused_fp8: 0 = the plan's
  // cuda_fused: programmatic dependent launches (unset: the policy's choice)
  std::optional<bool> dependent = std::nullopt;
  bool plan_in_gemms = true;  // cuda_fused at decode: the schedule built in the GEMMs (else the plan kernel)
  // cuda_fused with the stream GEMMs: their use of L2 (unset: the policy's)
  std::optional<mr::gpu::stream_l2_use> stream_l2 = std::nullopt;
  bool batch_invariant = false;
  // cuda_fused_fp8: the stream GEMMs, pairs of wgmma CTAs and 128-row wgmma CTAs forced on or
  // off, and the wgmma K loop (unset: its plan's rules)
  std::optional<bool> fp8_stream = std::nullopt, fp8_pairs = std::nullopt, fp8_tall = std::nullopt;
  std::optional<mr::gpu::fp8_k_loop> fp8_k_loop = std::nullopt;
  std::optional<bool> hand_out = std::nullopt;  // wgmma work items handed out at run time (unset: the plan's)
  std::optional<bool> fp8_quads = std::nullopt;  // cuda_fused_fp8: fours of wgmma CTAs (unset: the plan's)
  std::optional<int> fp8_down_k_splits = std::nullopt;  // cuda_fused_fp8: GEMM2's K splits (unset: the plan's)
  std::optional<bool> expert_bands = std::nullopt;  // wgmma raster bands of one expert's tiles (unset: the plan's)
  std::optional<bool> fp8_down_rows = std::nullopt;  // cuda_fused_fp8: GEMM2's rows or reductions (unset: the plan's)
  std::optional<bool> down_a_tma = std::nullopt;  // the wgmma GEMM2's A by TMA or cp.async (unset: the plan's)
  std::optional<bool> fp8_staged_down = std::nullopt;  // cuda_fused_fp8: GEMM2's store warps (unset: the plan's)
  std::optional<bool> fp8_dependent = std::nullopt;  // cuda_fused_fp8: dependent wgmma launches (unset: the plan's)
  std::optional<int> fp8_up_k_splits = std::nullopt;  // cuda_fused_fp8: GEMM1's K splits (unset: the plan's)
  std::optional<bool> fp8_staged_up = std::nullopt;  // cuda_fused_fp8: GEMM1's store warps (unset: the plan's)
  std::optional<bool> narrow = std::nullopt;  // the narrow decode tiles forced on or off (unset: the plan's)
  std::optional<bool> fp8_schedule_in_gemms = std::nullopt;  // cuda_fused_fp8: the decode GEMMs' own schedule (unset: the plan's)
  std::optional<int> narrow_tokens = std::nullopt;  // the narrow tiles' tokens per tile (unset: the plan's)
};
constexpr backend_variant backend_variants[] = {
    {"cuda_fused_det", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, true, true},
    {"cuda_fused_batch_invariant", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, true, true, 0, std::nullopt,
     true, std::nullopt, true},
    {"cuda_fused_mma", "cuda_fused", mr::gpu::gemm_tuning_choice::sm90, false, false},
    {"cuda_fused_m64", "cuda_fused", mr::gpu::gemm_tuning_choice::sm90_wgmma_m64, false, false},
    {"cuda_fused_m64n128", "cuda_fused", mr::gpu::gemm_tuning_choice::sm90_wgmma_m64n128, false, false},
    {"cuda_fused_m128", "cuda_fused", mr::gpu::gemm_tuning_choice::sm90_wgmma_m128, false, false},
    {"cuda_fused_m128x2", "cuda_fused", mr::gpu::gemm_tuning_choice::sm90_wgmma_m128x2, false, false},
    {"cuda_fused_stream", "cuda_fused", mr::gpu::gemm_tuning_choice::stream, false, false},
    {"cuda_fused_stream_ordered", "cuda_fused", mr::gpu::gemm_tuning_choice::stream_ordered, false, false},
    {"cuda_fused_band1", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 1},
    {"cuda_fused_band2", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 2},
    {"cuda_fused_band4", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 4},
    {"cuda_fused_pdl", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, true},
    {"cuda_fused_nopdl", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, false},
    {"cuda_fused_plankernel", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     false},
    {"cuda_fused_prefetch", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, mr::gpu::stream_l2_use{.prefetch_bytes = -1}},
    {"cuda_fused_prefetch_end", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, mr::gpu::stream_l2_use{.prefetch_bytes = -1, .prefetch_at_end = true}},
    {"cuda_fused_l2plain", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, mr::gpu::stream_l2_use{.evict_first = false, .fetch_256_min_k_tiles = 1 << 30}},
    {"cuda_fused_nofetch256", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, mr::gpu::stream_l2_use{.fetch_256_min_k_tiles = 1 << 30}},
    {"cuda_fused_fetch256", "cuda_fused", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, mr::gpu::stream_l2_use{.fetch_256_min_k_tiles = 0}},
    {"cuda_fused_fp8_wgmma", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, std::nullopt, false, false, false},
    {"cuda_fused_fp8_single", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, std::nullopt, false},
    {"cuda_fused_fp8_pairs", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, std::nullopt, true},
    {"cuda_fused_fp8_stream", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, true, std::nullopt},
    {"cuda_fused_fp8_m64", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, std::nullopt, false, std::nullopt, false, false},
    {"cuda_fused_fp8_m128", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0, std::nullopt,
     true, std::nullopt, false, std::nullopt, false, true},
    {"cuda_fused_fp8_plain", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, std::nullopt, std::nullopt, std::nullopt, mr::gpu::fp8_k_loop::plain},
    {"cuda_fused_fp8_overlap", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, std::nullopt, std::nullopt, std::nullopt, mr::gpu::fp8_k_loop::overlap},
    {"cuda_fused_fp8_stagger", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, std::nullopt, std::nullopt, std::nullopt, mr::gpu::fp8_k_loop::stagger},
    {"cuda_fused_fp8_pairs_overlap", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, std::nullopt, true, std::nullopt, mr::gpu::fp8_k_loop::overlap},
    {"cuda_fused_fp8_pairs_stagger", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 0,
     std::nullopt, true, std::nullopt, false, std::nullopt, true, std::nullopt, mr::gpu::fp8_k_loop::stagger},
    {"cuda_fused_fp8_band16", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 16},
    {"cuda_fused_fp8_overlap_band16", "cuda_fused_fp8", mr::gpu::gemm_tuning_choice::automatic, false, false, 16,
     std::nullopt, true, std::nullopt, false, std::nullopt, std::nullopt, std::nullopt, mr::gpu::fp8_k_loop::overlap},
    {.label = "cuda_fused_handed_out", .backend = "cuda_fused", .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false,
     .by_default = false, .hand_out = true},
    {.label = "cuda_fused_m128x2_handed_out", .backend = "cuda_fused",
     .tuning = mr::gpu::gemm_tuning_choice::sm90_wgmma_m128x2, .deterministic = false, .by_default = false,
     .hand_out = true},
    {.label = "cuda_fused_fp8_handed_out", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false,
     .by_default = false, .hand_out = true},
    {.label = "cuda_fused_fp8_single_handed_out", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_pairs = false, .hand_out = true},
    {.label = "cuda_fused_fp8_pairs_handed_out", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_pairs = true, .hand_out = true},
    {.label = "cuda_fused_fp8_quads", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_quads = true},
    {.label = "cuda_fused_fp8_down_split3", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_down_k_splits = 3},
    {.label = "cuda_fused_fp8_det", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = true, .by_default = false},
    {.label = "cuda_fused_fp8_rows", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_down_rows = true},
    {.label = "cuda_fused_fp8_reduce", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_down_rows = false},
    {.label = "cuda_fused_fp8_down_cp_async", .backend = "cuda_fused_fp8",
     .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false, .by_default = false,
     .down_a_tma = false},
    {.label = "cuda_fused_down_cp_async", .backend = "cuda_fused", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .down_a_tma = false},
    {.label = "cuda_fused_fp8_staged", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_k_loop = mr::gpu::fp8_k_loop::plain, .fp8_staged_down = true},
    {.label = "cuda_fused_fp8_direct", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_staged_down = false},
    {.label = "cuda_fused_fp8_up_split2", .backend = "cuda_fused_fp8",
     .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false, .by_default = false,
     .fp8_up_k_splits = 2},
    {.label = "cuda_fused_fp8_up_split3", .backend = "cuda_fused_fp8",
     .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false, .by_default = false,
     .fp8_up_k_splits = 3},
    {.label = "cuda_fused_fp8_staged_up", .backend = "cuda_fused_fp8",
     .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false, .by_default = false,
     .fp8_staged_up = true},
    {.label = "cuda_fused_fp8_dependent", .backend = "cuda_fused_fp8",
     .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false, .by_default = false,
     .fp8_dependent = true},
    {.label = "cuda_fused_fp8_narrow", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_stream = false, .narrow = true},
    {.label = "cuda_fused_fp8_wide", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .narrow = false},
    {.label = "cuda_fused_fp8_local_plan", .backend = "cuda_fused_fp8",
     .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false, .by_default = false,
     .fp8_schedule_in_gemms = true},
    {.label = "cuda_fused_narrow", .backend = "cuda_fused", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .narrow = true},
    {.label = "cuda_fused_narrow32", .backend = "cuda_fused", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .narrow = true, .narrow_tokens = 32},
    {.label = "cuda_fused_fp8_narrow32", .backend = "cuda_fused_fp8", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .fp8_stream = false, .narrow = true, .narrow_tokens = 32},
    {.label = "cuda_fused_narrow_pdl", .backend = "cuda_fused", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .dependent = true, .narrow = true},
    {.label = "cuda_fused_expert_bands", .backend = "cuda_fused", .tuning = mr::gpu::gemm_tuning_choice::automatic,
     .deterministic = false, .by_default = false, .expert_bands = true},
    {.label = "cuda_fused_fp8_expert_bands", .backend = "cuda_fused_fp8",
     .tuning = mr::gpu::gemm_tuning_choice::automatic, .deterministic = false, .by_default = false,
     .expert_bands = true},
};

const backend_variant* find_variant(std::string_view label) {
  for (const auto& v : backend_variants)
    if (v.label == label) return &v;
  return nullptr;
}

template <class R>
struct policy_names;
template <class... P>
struct policy_names<mr::MoeRunner<P...>> {
  static std::vector<std::string> get() { return {std::string(P::name)...}; }
};

struct shape_desc {
  std::string name;
  int e, k, h, i;
};

const std::vector<shape_desc> default_shapes = {
    {"Mixtral-8x7B", 8, 2, 4096, 14336},
    {"DeepSeek-V3", 256, 8, 7168, 2048},
    {"Qwen3-30B-A3B", 128, 8, 2048, 768},
};
const std::vector<int> default_tokens = {1, 8, 64, 512, 4096, 16384};

constexpr int routing_sets = 4;            // rotated within a cell so small cells do not live in L2
constexpr int max_weight_copies = 4;
constexpr std::int64_t reference_max_tokens = 64;  // up to here the CPU reference checks a subsample
constexpr int reference_subsample = 3;
// A cell whose max_rel_err is above this (bf16 output, f32 accumulate) is reported as a failure;
// fp8 rows are held to the fp8 bound against the reference's fp8 path (same quantization points).
constexpr double max_rel_err_limit = 2e-2;
constexpr double max_rel_err_limit_fp8 = 3e-2;

// ---------------------------------------------------------------- device memory and data

class dbuf {
 public:
  dbuf() = default;
  explicit dbuf(std::size_t bytes) : bytes_(bytes) {
    if (bytes_) MOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  dbuf(dbuf&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  dbuf& operator=(dbuf&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~dbuf() {
    if (ptr_) cudaFree(ptr_);
  }
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

__host__ __device__ inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform values in [-scale, scale) from a counter hash: reproducible and fast over 20+ GB.
template <class T>
__global__ void fill_uniform_kernel(T* p, std::size_t n, std::uint64_t seed, float scale) {
  const std::uint64_t s = mix64(seed);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix64(s + i) >> 40) * (1.0f / 16777216.0f);
    p[i] = static_cast<T>(scale * (2.0f * u - 1.0f));
  }
}

template <class T>
void fill_uniform(void* p, std::size_t n, std::uint64_t seed, float scale, cudaStream_t s) {
  if (n == 0) return;
  fill_uniform_kernel<T><<<1024, 256, 0, s>>>(static_cast<T*>(p), n, seed, scale);
  MOE_CUDA_CHECK_LAUNCH("fill_uniform_kernel");
}

// bf16 weights [E, rows, cols] -> e4m3 with one f32 scale per 128 x 128 block (amax / 448), as
// fp8 checkpoints ship them: one CTA per block. rows and cols are multiples of 128.
__global__ void quantize_blocks_kernel(const __nv_bfloat16* w, std::int64_t rows, std::int64_t cols,
                                       std::uint8_t* q, float* scales) {
  const std::int64_t br = rows / 128, bc = cols / 128;
  const std::int64_t b = blockIdx.x, e = b / (br * bc), r0 = (b / bc) % br * 128, c0 = b % bc * 128;
  const std::int64_t base = e * rows * cols + r0 * cols + c0;
  __shared__ float part[256];
  float amax = 0.0f;
  for (int i = threadIdx.x; i < 128 * 128; i += blockDim.x)
    amax = fmaxf(amax, fabsf(__bfloat162float(w[base + (i / 128) * cols + i % 128])));
  part[threadIdx.x] = amax;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o /= 2) {
    if (static_cast<int>(threadIdx.x) < o) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + o]);
    __syncthreads();
  }
  const float scale = part[0] > 0.0f ? part[0] / 448.0f : 1.0f;
  for (int i = threadIdx.x; i < 128 * 128; i += blockDim.x) {
    const std::int64_t at = base + (i / 128) * cols + i % 128;
    q[at] = __nv_cvt_float_to_fp8(__bfloat162float(w[at]) / scale, __NV_SATFINITE, __NV_E4M3);
  }
  if (threadIdx.x == 0) scales[b] = scale;
}

// Reads every 16-byte word once; the never-true store keeps the loads from being removed.
__global__ void read_bandwidth_kernel(const int4* __restrict__ p, std::size_t n, int* sink) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  int acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const int4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const int4 a = p[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x7fffffff) *sink = acc;
}

// ---------------------------------------------------------------- timing

constexpr double warmup_ms = 25.0;        // launches before timing starts, at least
constexpr double warmup_max_ms = 1000.0;  // and at most, while they still speed up

// Median per-launch time of launch(j), j = 0, 1, 2, ...: batches of launches long enough
// (>= ~1 ms) for event resolution not to matter, about 0.2 s of timing per call.
template <class F>
double median_launch_ms(cudaStream_t s, F&& launch) {
  event_pair ev;
  int j = 0;
  // Warm up for a while, not a few launches: after the host-side work between cells the clocks
  // need milliseconds to settle, and the first row of a small cell read 4-7% slower than the
  // same kernels in the next row. And, at least two batches, until a batch is no longer 1%
  // faster than every one before it: cuda_fused_det, timed right after cublas_grouped's direct
  // runs at Mixtral-8x7B 4096, read 13-16% slower than its own layer_ms timed next (an H100 and
  // an H200 run), and than the batch-invariant row after it, which runs the same plan.
  double best = std::numeric_limits<double>::infinity();
  double warm_ms = 0.0;
  for (int batch = 1;; ++batch) {
    ev.start(s);
    for (int r = 0; r < 8; ++r) launch(j++);
    const double t = ev.stop_ms(s);
    warm_ms += t;
    const bool speeding_up = t < 0.99 * best;
    best = std::min(best, t);
    if (warm_ms >= warmup_max_ms || (batch >= 2 && warm_ms >= warmup_ms && !speeding_up)) break;
  }
  ev.start(s);
  launch(j++);
  const double estimate = std::max(1e-3, static_cast<double>(ev.stop_ms(s)));
  const int per_batch = std::clamp(static_cast<int>(std::ceil(1.0 / estimate)), 1, 64);
  const int batches = std::clamp(static_cast<int>(200.0 / (estimate * per_batch)), 5, 15);
  std::vector<double> samples;
  for (int b = 0; b < batches; ++b) {
    ev.start(s);
    for (int r = 0; r < per_batch; ++r) launch(j++);
    samples.push_back(ev.stop_ms(s) / per_batch);
  }
  return median(samples);
}


// ---------------------------------------------------------------- ceilings

struct ceilings {
  double read_tbps = 0, copy_tbps = 0, gemm_tflops = 0, fp8_tflops = 0;
};

// cuBLASLt e4m3 x e4m3 -> bf16 GEMM at n^3 (f32 accumulate), TN as fp8 needs: its TFLOP/s.
double fp8_gemm_tflops(cudaStream_t s) {
  constexpr int n = 8192;
  const std::size_t elems = static_cast<std::size_t>(n) * n;
  dbuf a(elems), b(elems), d(elems * 2), ws(std::size_t{64} << 20);
  fill_uniform<__nv_fp8_e4m3>(a.get(), elems, 4, 1.0f, s);
  fill_uniform<__nv_fp8_e4m3>(b.get(), elems, 5, 1.0f, s);
  cublasLtHandle_t h = nullptr;
  MOE_CUBLAS_CHECK(cublasLtCreate(&h));
  std::unique_ptr<std::remove_pointer_t<cublasLtHandle_t>, decltype(&cublasLtDestroy)> owner(h, &cublasLtDestroy);
  cublasLtMatmulDesc_t desc = nullptr;
  MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt));
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, n, n));
  cublasLtMatmulPreference_t pref = nullptr;
  MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const std::size_t ws_bytes = ws.bytes();
  MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                        sizeof ws_bytes));
  cublasLtMatmulHeuristicResult_t algo{};
  int found = 0;
  MOE_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &algo, &found));
  double tflops = 0.0;
  if (found > 0) {
    const float alpha = 1.0f, beta = 0.0f;
    const double ms = median_launch_ms(s, [&](int) {
      MOE_CUBLAS_CHECK(cublasLtMatmul(h, desc, &alpha, a.get(), la, b.get(), lb, &beta, d.get(), ld, d.get(), ld,
                                      &algo.algo, ws.get(), ws_bytes, s));
    });
    tflops = 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e12;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  return tflops;
}

ceilings measure_ceilings(cudaStream_t s, int sm_count) {
  ceilings c;
  {
    const std::size_t bytes = std::size_t{4} << 30;
    dbuf buf(bytes), sink(sizeof(int));
    fill_uniform<float>(buf.get(), bytes / 4, 1, 1.0f, s);
    const std::size_t words = bytes / sizeof(int4);
    const double ms = median_launch_ms(s, [&](int) {
      read_bandwidth_kernel<<<sm_count * 4, 512, 0, s>>>(static_cast<const int4*>(buf.get()), words,
                                                        static_cast<int*>(sink.get()));
      MOE_CUDA_CHECK_LAUNCH("read_bandwidth_kernel");
    });
    c.read_tbps = static_cast<double>(bytes) / (ms * 1e-3) / 1e12;
    const std::size_t half = bytes / 2;
    char* base = static_cast<char*>(buf.get());
    const double copy_ms = median_launch_ms(
        s, [&](int) { MOE_CUDA_CHECK(cudaMemcpyAsync(base + half, base, half, cudaMemcpyDeviceToDevice, s)); });
    c.copy_tbps = 2.0 * static_cast<double>(half) / (copy_ms * 1e-3) / 1e12;
  }
  {
    constexpr int n = 8192;
    const std::size_t elems = static_cast<std::size_t>(n) * n;
    dbuf a(elems * 2), b(elems * 2), d(elems * 2);
    fill_uniform<__nv_bfloat16>(a.get(), elems, 2, 1.0f, s);
    fill_uniform<__nv_bfloat16>(b.get(), elems, 3, 1.0f, s);
    cublasHandle_t h = nullptr;
    MOE_CUBLAS_CHECK(cublasCreate(&h));
    std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, decltype(&cublasDestroy)> owner(h, &cublasDestroy);
    MOE_CUBLAS_CHECK(cublasSetStream(h, s));
    const float alpha = 1.0f, beta = 0.0f;
    const double ms = median_launch_ms(s, [&](int) {
      MOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n, b.get(),
                                    CUDA_R_16BF, n, &beta, d.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
    });
    c.gemm_tflops = 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e12;
  }
  c.fp8_tflops = fp8_gemm_tflops(s);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return c;
}

// ---------------------------------------------------------------- one cell's inputs

// Tokens, router logits and their softmax top-k routing, all on the device.
struct routing_set {
  dbuf x, logits, weights, ids;
  mr::tensor_view xv, wv, iv;
  std::vector<std::int32_t> host_ids;
  int distinct_experts = 0;
};

mr::topk_config bench_topk_config(int k) { return mr::topk_config{.top_k = k, .scoring = mr::scoring_func::softmax, .renormalize = true}; }

routing_set make_routing_set(const shape_desc& sh, std::int64_t m, std::uint64_t seed, cudaStream_t s) {
  const auto dev = mr::memory_space::device;
  routing_set r;
  r.x = dbuf(static_cast<std::size_t>(m) * sh.h * 2);
  r.logits = dbuf(static_cast<std::size_t>(m) * sh.e * 4);
  r.weights = dbuf(static_cast<std::size_t>(m) * sh.k * 4);
  r.ids = dbuf(static_cast<std::size_t>(m) * sh.k * 4);
  fill_uniform<__nv_bfloat16>(r.x.get(), static_cast<std::size_t>(m) * sh.h, seed, 1.0f, s);
  fill_uniform<float>(r.logits.get(), static_cast<std::size_t>(m) * sh.e, seed + 1, 4.0f, s);
  r.xv = mr::tensor_view::contiguous(r.x.get(), mr::dtype::bf16, {m, sh.h}, dev);
  r.wv = mr::tensor_view::contiguous(r.weights.get(), mr::dtype::f32, {m, sh.k}, dev);
  r.iv = mr::tensor_view::contiguous(r.ids.get(), mr::dtype::i32, {m, sh.k}, dev);
  const auto lv = mr::tensor_view::contiguous(r.logits.get(), mr::dtype::f32, {m, sh.e}, dev);
  mr::TopKOutput out{r.wv, r.iv, false};
  mr::gpu::topk(lv, nullptr, bench_topk_config(sh.k), out, s);
  r.host_ids.resize(static_cast<std::size_t>(m) * sh.k);
  MOE_CUDA_CHECK(cudaMemcpyAsync(r.host_ids.data(), r.ids.get(), r.host_ids.size() * 4, cudaMemcpyDeviceToHost, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  std::set<std::int32_t> distinct;
  for (std::int32_t id : r.host_ids)
    if (id >= 0) distinct.insert(id);
  r.distinct_experts = static_cast<int>(distinct.size());
  return r;
}

// gpu::topk of the set's logits into its own weights and ids (the same values again).
void route(const shape_desc& sh, const routing_set& r, std::int64_t m, cudaStream_t s) {
  const auto lv = mr::tensor_view::contiguous(r.logits.get(), mr::dtype::f32, {m, sh.e}, mr::memory_space::device);
  mr::TopKOutput out{r.wv, r.iv, false};
  mr::gpu::topk(lv, nullptr, bench_topk_config(sh.k), out, s);
}

struct routing_times {
  double topk_ms = std::numeric_limits<double>::quiet_NaN();
  double with_plan_ms = std::numeric_limits<double>::quiet_NaN();  // topk + routing plan + M-tile schedule
};

routing_times routing_ms(const shape_desc& sh, const routing_set& r, std::int64_t m, cudaStream_t s) {
  routing_times t;
  const graph_exec g = graph_exec::capture(s, [&](cudaStream_t cs) { route(sh, r, m, cs); });
  t.topk_ms = median_launch_ms(s, [&](int) { g.launch(s); });
  const std::size_t plan_bytes = mr::gpu::routing_plan_bytes(m, sh.k, sh.e);
  // cuda_fused's own plan for the cell says which schedule it builds and how it launches it:
  // with the stream GEMMs (decode) the plan kernel is a programmatic dependent of topk, and up
  // to local_plan_max_slots slots no plan kernel runs (the GEMMs order the rows themselves).
  const mr::gpu::fused_plan fused =
      mr::cuda_fused_policy(mr::MoeRunnerConfig(
                                {.num_experts = sh.e, .hidden_size = sh.h, .intermediate_size = sh.i, .top_k = sh.k}))
          .plan(m);
  const int block_m = fused.schedule_block_m;
  const bool dependent = fused.dependent_launch;
  if (fused.schedule_in_gemms) {
    t.with_plan_ms = t.topk_ms;
    return t;
  }
  const std::size_t schedule_bytes = mr::gpu::tile_schedule_bytes(m * sh.k, sh.e, block_m);
  dbuf plan_ws(plan_bytes), schedule_ws(schedule_bytes);
  const auto plan = [&](cudaStream_t cs) {
    route(sh, r, m, cs);
    mr::gpu::build_routing_plan_and_schedule(r.iv, sh.e, block_m, plan_ws.get(), plan_bytes,
                                             schedule_ws.get(), schedule_bytes, cs, dependent);
  };
  const graph_exec gp = graph_exec::capture(s, plan);
  t.with_plan_ms = median_launch_ms(s, [&](int) { gp.launch(s); });
  return t;
}

// ---------------------------------------------------------------- checks

// ||a_t - b_t|| / ||b_t|| for one token row; +inf when either row holds a NaN or an inf.
double row_rel_err(const std::uint16_t* a, const std::uint16_t* b, int h) {
  double num = 0.0, den = 0.0;
  for (int c = 0; c < h; ++c) {
    const double x = mr::host_float::bf16_to_float(a[c]), y = mr::host_float::bf16_to_float(b[c]);
    if (!std::isfinite(x) || !std::isfinite(y)) return std::numeric_limits<double>::infinity();
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<std::int64_t> subsample_tokens(std::int64_t m) {
  std::vector<std::int64_t> t = {0, m / 2, m - 1};
  std::sort(t.begin(), t.end());
  t.erase(std::unique(t.begin(), t.end()), t.end());
  if (static_cast<int>(t.size()) > reference_subsample) t.resize(reference_subsample);
  return t;
}

// The CPU reference's output rows for a few tokens of routing set 0. Each token runs alone,
// in its own thread, on host copies of just its k experts (slot j -> local expert j).
struct reference_rows {
  std::vector<std::int64_t> tokens;
  std::vector<std::vector<std::uint16_t>> rows;  // bf16 [H] per token
};

// A shape's weights on the device: bf16 copies, and where an fp8 row runs their e4m3 copies with
// 128 x 128 block scales (quantized from the bf16 ones).
struct shape_weights {
  std::vector<dbuf> w13, w2, q13, q2, s13, s2;
  std::vector<mr::unquantized_quant_info> bf16;
  std::vector<mr::fp8_block_quant_info> fp8;
};

reference_rows cpu_reference(const shape_desc& sh, const routing_set& r, const shape_weights& w, bool fp8,
                             std::int64_t m) {
  const int k = sh.k, h = sh.h, inter = sh.i, rows13 = 2 * sh.i;
  const std::size_t es = fp8 ? 1 : 2;  // bytes per weight
  const std::size_t w13_expert = static_cast<std::size_t>(rows13) * h, w2_expert = static_cast<std::size_t>(h) * inter;
  const std::size_t s13_expert = w13_expert / (128 * 128), s2_expert = w2_expert / (128 * 128);
  const dbuf& w13 = fp8 ? w.q13[0] : w.w13[0];
  const dbuf& w2 = fp8 ? w.q2[0] : w.w2[0];
  reference_rows out;
  out.tokens = subsample_tokens(m);
  const std::size_t n = out.tokens.size();
  std::vector<std::vector<std::uint16_t>> x(n, std::vector<std::uint16_t>(h));
  std::vector<std::vector<std::uint8_t>> a(n), b(n);
  std::vector<std::vector<float>> sa(n), sb(n);
  std::vector<std::vector<float>> wts(n, std::vector<float>(k));
  std::vector<std::vector<std::int32_t>> ids(n, std::vector<std::int32_t>(k));
  for (std::size_t q = 0; q < n; ++q) {
    const std::int64_t t = out.tokens[q];
    MOE_CUDA_CHECK(cudaMemcpy(x[q].data(), static_cast<const char*>(r.x.get()) + t * h * 2, h * 2,
                              cudaMemcpyDeviceToHost));
    MOE_CUDA_CHECK(cudaMemcpy(wts[q].data(), static_cast<const float*>(r.weights.get()) + t * k, k * 4,
                              cudaMemcpyDeviceToHost));
    a[q].resize(w13_expert * k * es);
    b[q].resize(w2_expert * k * es);
    if (fp8) {
      sa[q].resize(s13_expert * k);
      sb[q].resize(s2_expert * k);
    }
    for (int j = 0; j < k; ++j) {
      const std::int32_t e = r.host_ids[t * k + j];
      ids[q][j] = e < 0 ? -1 : j;
      if (e < 0) continue;
      MOE_CUDA_CHECK(cudaMemcpy(a[q].data() + j * w13_expert * es,
                                static_cast<const char*>(w13.get()) + e * w13_expert * es, w13_expert * es,
                                cudaMemcpyDeviceToHost));
      MOE_CUDA_CHECK(cudaMemcpy(b[q].data() + j * w2_expert * es, static_cast<const char*>(w2.get()) + e * w2_expert * es,
                                w2_expert * es, cudaMemcpyDeviceToHost));
      if (fp8) {
        MOE_CUDA_CHECK(cudaMemcpy(sa[q].data() + j * s13_expert, static_cast<const float*>(w.s13[0].get()) + e * s13_expert,
                                  s13_expert * 4, cudaMemcpyDeviceToHost));
        MOE_CUDA_CHECK(cudaMemcpy(sb[q].data() + j * s2_expert, static_cast<const float*>(w.s2[0].get()) + e * s2_expert,
                                  s2_expert * 4, cudaMemcpyDeviceToHost));
      }
    }
  }
  out.rows.assign(n, std::vector<std::uint16_t>(h));
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (std::size_t q = 0; q < n; ++q) {
    threads.emplace_back([&, q] {
      try {
        const auto host = mr::memory_space::host;
        const mr::MoeRunnerConfig cfg({.num_experts = k, .hidden_size = h, .intermediate_size = inter, .top_k = k});
        mr::MoeRunner<mr::reference_policy> ref("reference", cfg);
        const mr::DispatchOutput d{mr::tensor_view::contiguous(x[q].data(), mr::dtype::bf16, {1, h}, host),
                                   {},
                                   {mr::tensor_view::contiguous(wts[q].data(), mr::dtype::f32, {1, k}, host),
                                    mr::tensor_view::contiguous(ids[q].data(), mr::dtype::i32, {1, k}, host),
                                    false}};
        const mr::tensor_view o = mr::tensor_view::contiguous(out.rows[q].data(), mr::dtype::bf16, {1, h}, host);
        const mr::dtype wt = fp8 ? mr::dtype::f8_e4m3 : mr::dtype::bf16;
        const mr::tensor_view av = mr::tensor_view::contiguous(a[q].data(), wt, {k, rows13, h}, host);
        const mr::tensor_view bv = mr::tensor_view::contiguous(b[q].data(), wt, {k, h, inter}, host);
        if (fp8)
          ref.run(d,
                  mr::fp8_block_quant_info{
                      av, mr::tensor_view::contiguous(sa[q].data(), mr::dtype::f32, {k, rows13 / 128, h / 128}, host),
                      bv, mr::tensor_view::contiguous(sb[q].data(), mr::dtype::f32, {k, h / 128, inter / 128}, host)},
                  o, {}, cuda::stream_ref(cudaStream_t{}));
        else ref.run(d, mr::unquantized_quant_info{av, bv}, o, {}, cuda::stream_ref(cudaStream_t{}));
      } catch (...) {
        errors[q] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

// ---------------------------------------------------------------- output

struct cell_result {
  std::string backend;
  bool ok = false;
  std::string error;
  std::string timing;  // "cuda_graph" or "direct"
  double ms = 0.0;
  double layer_ms = std::numeric_limits<double>::quiet_NaN();  // topk + run in one graph
  std::size_t workspace_bytes = 0;
  std::string plan;                 // the runner's describe(M): what ran
  std::vector<std::uint16_t> out;  // routing set 0's output, bf16 [M, H]
  bool nonfinite = false;           // a NaN or inf anywhere in out
  double max_rel_err = 0.0;
  double ref_rel_err = 0.0;         // against the CPU reference on a few tokens
  std::string check;
};

// ---------------------------------------------------------------- one cell

template <class QuantInfo>
cell_result run_backend(const std::string& name, const shape_desc& sh, std::int64_t m,
                        const std::vector<routing_set>& sets, const std::vector<QuantInfo>& weights, cudaStream_t s,
                        bool once) {
  cell_result res;
  res.backend = name;
  try {
    const backend_variant* variant = find_variant(name);
    const mr::MoeRunnerConfig cfg({.num_experts = sh.e,
                                   .hidden_size = sh.h,
                                   .intermediate_size = sh.i,
                                   .top_k = sh.k,
                                   .deterministic = variant != nullptr && variant->deterministic,
                                   .batch_invariant = variant != nullptr && variant->batch_invariant});
    bench_runner runner(variant != nullptr ? std::string(variant->backend) : name, cfg);
    if (variant != nullptr) {
      runner.visit([&](auto& core) {
        if constexpr (requires { core.set_gemm_tuning(variant->tuning); }) {
          core.set_gemm_tuning(variant->tuning);
          core.set_raster_band(variant->raster_band);
          if (variant->dependent) core.set_dependent_launch(*variant->dependent);
          core.set_plan_in_gemms(variant->plan_in_gemms);
          if (variant->stream_l2) core.set_stream_l2(*variant->stream_l2);
          core.set_hand_out(variant->hand_out);
          core.set_expert_bands(variant->expert_bands);
          core.set_down_a_tma(variant->down_a_tma);
          core.set_narrow(variant->narrow);
          core.set_narrow_tokens(variant->narrow_tokens);
        } else if constexpr (requires { core.set_stream_gemms(variant->fp8_stream); }) {
          core.set_stream_gemms(variant->fp8_stream);
          core.set_pairs(variant->fp8_pairs);
          core.set_quads(variant->fp8_quads);
          core.set_down_k_splits(variant->fp8_down_k_splits);
          core.set_tall(variant->fp8_tall);
          core.set_k_loop(variant->fp8_k_loop);
          if (variant->raster_band > 0) core.set_raster_band(variant->raster_band);
          core.set_hand_out(variant->hand_out);
          core.set_expert_bands(variant->expert_bands);
          core.set_down_rows(variant->fp8_down_rows);
          core.set_down_a_tma(variant->down_a_tma);
          core.set_staged_down(variant->fp8_staged_down);
          core.set_dependent_gemms(variant->fp8_dependent);
          core.set_up_k_splits(variant->fp8_up_k_splits);
          core.set_staged_up(variant->fp8_staged_up);
          core.set_narrow(variant->narrow);
          core.set_narrow_tokens(variant->narrow_tokens);
          core.set_schedule_in_gemms(variant->fp8_schedule_in_gemms);
        } else {
          throw std::runtime_error(name + ": the backend has no GEMM tuning to set");
        }
      });
    }
    const bool capturable = runner.visit([](const auto& core) {
      using P = std::decay_t<decltype(core)>;
      if constexpr (requires { P::graph_capturable; }) return static_cast<bool>(P::graph_capturable);
      else return true;
    });
    res.workspace_bytes = runner.workspace_bytes(m);
    res.plan = runner.describe(m);
    dbuf ws(res.workspace_bytes), out(static_cast<std::size_t>(m) * sh.h * 2);
    const auto outv = mr::tensor_view::contiguous(out.get(), mr::dtype::bf16, {m, sh.h}, mr::memory_space::device);
    const auto run_set = [&](int j, cudaStream_t cs) {
      const routing_set& r = sets[j % sets.size()];
      const mr::DispatchOutput d{r.xv, {}, {r.wv, r.iv, false}};
      runner.run(d, weights[j % weights.size()], outv, {ws.get(), ws.bytes()}, cuda::stream_ref(cs));
    };
    run_set(0, s);  // first run outside any capture: lazy set-up, and errors surface plainly
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    if (once) {
      res.ok = true;
      res.timing = "once";
      return res;
    }
    if (capturable) {
      std::vector<graph_exec> graphs;
      for (std::size_t j = 0; j < sets.size(); ++j)
        graphs.push_back(graph_exec::capture(s, [&](cudaStream_t cs) { run_set(static_cast<int>(j), cs); }));
      res.timing = "cuda_graph";
      res.ms = median_launch_ms(s, [&](int j) { graphs[j % graphs.size()].launch(s); });
      // The layer as an engine runs it: routing from the logits, then the run, in one graph.
      std::vector<graph_exec> layers;
      for (std::size_t j = 0; j < sets.size(); ++j)
        layers.push_back(graph_exec::capture(s, [&](cudaStream_t cs) {
          route(sh, sets[j], m, cs);
          run_set(static_cast<int>(j), cs);
        }));
      res.layer_ms = median_launch_ms(s, [&](int j) { layers[j % layers.size()].launch(s); });
    } else {
      res.timing = "direct";
      res.ms = median_launch_ms(s, [&](int j) { run_set(j, s); });
    }
    // The output checked is a fresh run on set 0 over a NaN-poisoned buffer.
    MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), s));
    run_set(0, s);
    res.out.resize(static_cast<std::size_t>(m) * sh.h);
    MOE_CUDA_CHECK(cudaMemcpyAsync(res.out.data(), out.get(), out.bytes(), cudaMemcpyDeviceToHost, s));
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    res.nonfinite = std::any_of(res.out.begin(), res.out.end(),
                                [](std::uint16_t v) { return (v & 0x7f80u) == 0x7f80u; });  // bf16 exponent all ones
    res.ok = true;
  } catch (const std::exception& e) {
    res.error = e.what();
    cudaStreamSynchronize(s);
    cudaGetLastError();  // a sticky error would poison every later cell; report it and go on
  }
  return res;
}

struct options {
  std::string out_path = "moe_bench.jsonl";
  std::string commit = "unknown";
  std::vector<std::string> shapes, backends;  // shapes: the named ones asked for
  bool shapes_given = false;
  std::vector<shape_desc> extra_shapes;  // asked for as NAME:E:K:H:I
  std::vector<int> tokens = default_tokens;
  bool once = false;  // one run per cell, no timing, no ceilings: for running under a profiler
};

// A shape the bench does not name, NAME:E:K:H:I (experts, top-k, hidden, intermediate).
shape_desc parse_shape(const std::string& spec) {
  std::vector<std::string> f;
  std::size_t at = 0;
  for (std::size_t colon; (colon = spec.find(':', at)) != std::string::npos; at = colon + 1)
    f.push_back(spec.substr(at, colon - at));
  f.push_back(spec.substr(at));
  shape_desc sh{};
  try {
    if (f.size() != 5 || f[0].empty()) throw std::invalid_argument("fields");
    sh = {f[0], std::stoi(f[1]), std::stoi(f[2]), std::stoi(f[3]), std::stoi(f[4])};
  } catch (const std::exception&) {
    std::fprintf(stderr, "moe_bench: a shape is NAME:E:K:H:I with positive integers, got %s\n", spec.c_str());
    std::exit(2);
  }
  if (sh.e <= 0 || sh.k <= 0 || sh.k > sh.e || sh.h <= 0 || sh.i <= 0) {
    std::fprintf(stderr, "moe_bench: a shape needs E, H, I > 0 and 0 < K <= E, got %s\n", spec.c_str());
    std::exit(2);
  }
  return sh;
}

options parse_args(int argc, char** argv) {
  options o;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    const auto value = [&] { return option_value(a, argc, argv, "moe_bench"); };
    if (arg == "--out") o.out_path = value();
    else if (arg == "--commit") o.commit = value();
    else if (arg == "--shapes") {
      o.shapes_given = true;
      for (const auto& item : split(value())) {
        if (item.find(':') != std::string::npos) o.extra_shapes.push_back(parse_shape(item));
        else o.shapes.push_back(item);
      }
    }
    else if (arg == "--backends") o.backends = split(value());
    else if (arg == "--once") o.once = true;
    else if (arg == "--tokens") {
      o.tokens.clear();
      for (const auto& t : split(value())) o.tokens.push_back(std::stoi(t));
    } else {
      std::fprintf(stderr,
                   "usage: moe_bench [--out FILE.jsonl] [--commit SHA] [--shapes A,B,NAME:E:K:H:I] [--tokens 1,8,...] "
                   "[--backends cuda_fused,cublas_grouped,cuda_fused_det,cuda_fused_mma] [--once]\n");
      std::exit(arg == "--help" || arg == "-h" ? 0 : 2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse_args(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "moe_bench: no CUDA device\n");
    return 1;
  }
  const auto wall_start = std::chrono::steady_clock::now();
  cudaDeviceProp prop{};
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  std::vector<std::string> backends = opt.backends;
  if (backends.empty()) {
    backends = policy_names<bench_runner>::get();
    for (const auto& v : backend_variants)
      if (v.by_default) backends.emplace_back(v.label);
  }
  std::vector<shape_desc> shapes;
  for (const auto& sh : default_shapes)
    if (!opt.shapes_given || std::find(opt.shapes.begin(), opt.shapes.end(), sh.name) != opt.shapes.end())
      shapes.push_back(sh);
  shapes.insert(shapes.end(), opt.extra_shapes.begin(), opt.extra_shapes.end());

  std::ofstream jsonl(opt.out_path);
  if (!jsonl) {
    std::fprintf(stderr, "moe_bench: cannot write %s\n", opt.out_path.c_str());
    return 1;
  }

  const ceilings c = opt.once ? ceilings{} : measure_ceilings(s, prop.multiProcessorCount);
  // 2-CTA clusters of the 128-row wgmma GEMM that run at once (a cluster's SMs share a GPC).
  int pair_clusters = 0;
  if (const mr::gpu::device_facts dev = mr::gpu::current_device_facts(); mr::gpu::wgmma_gemm_available(dev))
    pair_clusters = mr::gpu::prepare_wgmma_gemm<__nv_bfloat16, mr::gpu::sm90_wgmma_m128x2_gemm_policy,
                                                mr::kernels::moe_gemm_kind::down, false>(dev);
  std::printf("GPU %s (%d SMs, L2 %.0f MB), commit %s\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6,
              opt.commit.c_str());
  std::printf("ceilings: HBM read %.2f TB/s, D2D copy %.2f TB/s (read+write), cuBLAS bf16 GEMM 8192^3 %.0f TFLOP/s, "
              "cuBLASLt e4m3 GEMM 8192^3 %.0f TFLOP/s\n",
              c.read_tbps, c.copy_tbps, c.gemm_tflops, c.fp8_tflops);
  std::printf("wgmma 2-CTA clusters resident at once: %d\n\n", pair_clusters);
  jsonl << "{\"gpu\":" << json_string(prop.name) << ",\"commit\":" << json_string(opt.commit)
        << ",\"date\":" << json_string(utc_now()) << ",\"read_TBps\":" << json_number(c.read_tbps)
        << ",\"copy_TBps\":" << json_number(c.copy_tbps) << ",\"gemm_TFLOPs\":" << json_number(c.gemm_tflops)
        << ",\"fp8_TFLOPs\":" << json_number(c.fp8_tflops)
        << ",\"sm_count\":" << prop.multiProcessorCount << ",\"pair_clusters\":" << pair_clusters
        << ",\"l2_MB\":" << json_number(prop.l2CacheSize / 1e6)
        << ",\"dtype\":\"bf16\",\"routing\":\"softmax top-k, renormalized, f32 logits U(-4,4)\"}\n";
  jsonl.flush();

  std::printf("%-16s %-15s %6s %10s %10s %7s %9s %9s %11s %-18s %9s %10s %10s %10s %9s %s\n", "backend", "shape",
              "tokens", "ms", "floor_ms", "floor%", "TFLOP/s", "GB/s", "max_rel_err", "check", "ref_err", "routing_ms",
              "route+plan", "layer_ms", "ws_MB", "timing");
  int failures = 0;
  for (const auto& sh : shapes) {
    const std::size_t w13_elems = static_cast<std::size_t>(sh.e) * 2 * sh.i * sh.h;
    const std::size_t w2_elems = static_cast<std::size_t>(sh.e) * sh.h * sh.i;
    const double weight_bytes = 2.0 * static_cast<double>(w13_elems + w2_elems);
    // Extra weight copies only when one copy would sit in L2 across launches.
    const int copies = std::clamp(static_cast<int>(std::ceil(4.0 * prop.l2CacheSize / weight_bytes)), 1,
                                  max_weight_copies);
    const bool any_fp8 = std::any_of(backends.begin(), backends.end(), [](const std::string& b) { return is_fp8_backend(b); });
    shape_weights weights;
    for (int cpy = 0; cpy < copies; ++cpy) {
      weights.w13.emplace_back(w13_elems * 2);
      weights.w2.emplace_back(w2_elems * 2);
      fill_uniform<__nv_bfloat16>(weights.w13[cpy].get(), w13_elems, 100 + cpy,
                                  2.0f / std::sqrt(static_cast<float>(sh.h)), s);
      fill_uniform<__nv_bfloat16>(weights.w2[cpy].get(), w2_elems, 200 + cpy,
                                  2.0f / std::sqrt(static_cast<float>(sh.i)), s);
      const auto dev = mr::memory_space::device;
      weights.bf16.push_back(
          {mr::tensor_view::contiguous(weights.w13[cpy].get(), mr::dtype::bf16, {sh.e, 2 * sh.i, sh.h}, dev),
           mr::tensor_view::contiguous(weights.w2[cpy].get(), mr::dtype::bf16, {sh.e, sh.h, sh.i}, dev)});
      if (!any_fp8) continue;
      const std::size_t s13_elems = w13_elems / (128 * 128), s2_elems = w2_elems / (128 * 128);
      weights.q13.emplace_back(w13_elems);
      weights.q2.emplace_back(w2_elems);
      weights.s13.emplace_back(s13_elems * 4);
      weights.s2.emplace_back(s2_elems * 4);
      quantize_blocks_kernel<<<static_cast<unsigned>(s13_elems), 256, 0, s>>>(
          static_cast<const __nv_bfloat16*>(weights.w13[cpy].get()), 2 * sh.i, sh.h,
          static_cast<std::uint8_t*>(weights.q13[cpy].get()), static_cast<float*>(weights.s13[cpy].get()));
      quantize_blocks_kernel<<<static_cast<unsigned>(s2_elems), 256, 0, s>>>(
          static_cast<const __nv_bfloat16*>(weights.w2[cpy].get()), sh.h, sh.i,
          static_cast<std::uint8_t*>(weights.q2[cpy].get()), static_cast<float*>(weights.s2[cpy].get()));
      MOE_CUDA_CHECK_LAUNCH("quantize_blocks_kernel");
      weights.fp8.push_back(
          {mr::tensor_view::contiguous(weights.q13[cpy].get(), mr::dtype::f8_e4m3, {sh.e, 2 * sh.i, sh.h}, dev),
           mr::tensor_view::contiguous(weights.s13[cpy].get(), mr::dtype::f32, {sh.e, 2 * sh.i / 128, sh.h / 128}, dev),
           mr::tensor_view::contiguous(weights.q2[cpy].get(), mr::dtype::f8_e4m3, {sh.e, sh.h, sh.i}, dev),
           mr::tensor_view::contiguous(weights.s2[cpy].get(), mr::dtype::f32, {sh.e, sh.h / 128, sh.i / 128}, dev)});
    }
    for (const int tokens : opt.tokens) {
      const std::int64_t m = tokens;
      std::vector<routing_set> sets;
      for (int j = 0; j < routing_sets; ++j) sets.push_back(make_routing_set(sh, m, 1000 * tokens + 17 * j, s));
      routing_times route_ms;
      try {
        if (!opt.once) route_ms = routing_ms(sh, sets[0], m, s);
      } catch (const std::exception& e) {
        std::printf("routing timing failed for %s M=%d: %s\n", sh.name.c_str(), tokens, e.what());
        cudaGetLastError();
      }

      // Bytes and flops: the experts each routing set touches, averaged over the sets.
      double touched = 0.0;
      for (const auto& r : sets) touched += r.distinct_experts;
      touched /= static_cast<double>(sets.size());
      // fp8 rows: weights at 1 byte plus one f32 scale per 128 x 128 block, the fp8 GEMM rate.
      const double expert_elems = 2.0 * sh.i * sh.h + static_cast<double>(sh.h) * sh.i;
      const double io_bytes = 2.0 * 2.0 * static_cast<double>(m) * sh.h + 8.0 * static_cast<double>(m) * sh.k;
      const double flops = 6.0 * static_cast<double>(m) * sh.k * sh.h * static_cast<double>(sh.i);
      const auto bytes_of = [&](bool fp8) {
        return touched * expert_elems * (fp8 ? 1.0 + 4.0 / (128.0 * 128.0) : 2.0) + io_bytes;
      };
      const auto floor_of = [&](bool fp8) {
        return std::max(bytes_of(fp8) / (c.read_tbps * 1e12), flops / ((fp8 ? c.fp8_tflops : c.gemm_tflops) * 1e12)) *
               1e3;
      };

      std::vector<cell_result> results;
      for (const auto& b : backends)
        results.push_back(is_fp8_backend(b) ? run_backend(b, sh, m, sets, weights.fp8, s, opt.once)
                                            : run_backend(b, sh, m, sets, weights.bf16, s, opt.once));
      if (opt.once) {
        for (const auto& r : results)
          std::printf("%-16s %-15s %6d  %s\n", r.backend.c_str(), sh.name.c_str(), tokens,
                      r.ok ? "ran once" : ("FAILED: " + r.error).c_str());
        continue;
      }

      // Every cell is checked against the CPU reference on a few tokens (ref_rel_err); above
      // reference_max_tokens, max_rel_err is the full comparison with the other GPU backend.
      // fp8 rows are checked against the reference's fp8 path, and compared in full only with
      // another fp8 row.
      std::optional<reference_rows> ref, ref_fp8;
      std::string ref_problem;
      for (bool fp8 : {false, true}) {
        if (!std::any_of(results.begin(), results.end(),
                         [&](const cell_result& r) { return r.ok && is_fp8_backend(r.backend) == fp8; }))
          continue;
        try {
          (fp8 ? ref_fp8 : ref) = cpu_reference(sh, sets[0], weights, fp8, m);
        } catch (const std::exception& e) {
          ref_problem = e.what();
        }
      }
      for (cell_result& r : results) {
        if (!r.ok) continue;
        const bool fp8 = is_fp8_backend(r.backend);
        const std::optional<reference_rows>& ref_rows = fp8 ? ref_fp8 : ref;
        const cell_result* other = nullptr;
        for (const auto& o : results)
          if (&o != &r && o.ok && is_fp8_backend(o.backend) == fp8) {
            other = &o;
            break;
          }
        r.ref_rel_err = std::numeric_limits<double>::quiet_NaN();
        if (ref_rows) {
          const reference_rows& rr = *ref_rows;
          double worst = 0.0;
          for (std::size_t q = 0; q < rr.tokens.size(); ++q)
            worst = std::max(worst, row_rel_err(r.out.data() + rr.tokens[q] * sh.h, rr.rows[q].data(), sh.h));
          r.ref_rel_err = worst;
        }
        if (m > reference_max_tokens && other != nullptr) {
          double worst = 0.0;
          for (std::int64_t t = 0; t < m; ++t)
            worst = std::max(worst, row_rel_err(r.out.data() + t * sh.h, other->out.data() + t * sh.h, sh.h));
          r.max_rel_err = worst;
          r.check = "vs_" + other->backend;
        } else {
          r.max_rel_err = r.ref_rel_err;
          r.check = ref_rows ? "reference_cpu" : "reference_cpu failed: " + ref_problem;
        }
        // Tokens outside the subsample are still scanned: a NaN or inf anywhere fails the cell.
        if (r.nonfinite) r.max_rel_err = std::numeric_limits<double>::infinity();
      }

      for (const auto& r : results) {
        if (!r.ok) {
          ++failures;
          std::printf("%-16s %-15s %6d  FAILED: %s\n", r.backend.c_str(), sh.name.c_str(), tokens, r.error.c_str());
          jsonl << "{\"backend\":" << json_string(r.backend) << ",\"shape\":" << json_string(sh.name)
                << ",\"tokens\":" << tokens << ",\"ms\":null,\"error\":" << json_string(r.error) << "}\n";
          continue;
        }
        const bool fp8 = is_fp8_backend(r.backend);
        const double floor_ms = floor_of(fp8), bytes = bytes_of(fp8);
        const double frac = floor_ms / r.ms;
        const double tflops = flops / (r.ms * 1e-3) / 1e12, gbps = bytes / (r.ms * 1e-3) / 1e9;
        const double limit = fp8 ? max_rel_err_limit_fp8 : max_rel_err_limit;
        char err[32], ref_err[32];
        if (std::isfinite(r.max_rel_err)) std::snprintf(err, sizeof err, "%.2e", r.max_rel_err);
        else std::snprintf(err, sizeof err, "NaN");
        if (std::isfinite(r.ref_rel_err)) std::snprintf(ref_err, sizeof ref_err, "%.2e", r.ref_rel_err);
        else std::snprintf(ref_err, sizeof ref_err, "NaN");
        const bool check_ok = std::isfinite(r.max_rel_err) && r.max_rel_err <= limit && std::isfinite(r.ref_rel_err) &&
                              r.ref_rel_err <= limit;
        if (!check_ok) ++failures;
        std::printf("%-16s %-15s %6d %10.4f %10.4f %6.1f%% %9.1f %9.1f %11s %-18s %9s %10.4f %10.4f %10.4f %9.2f %s%s\n",
                    r.backend.c_str(), sh.name.c_str(), tokens, r.ms, floor_ms, 100.0 * frac, tflops, gbps, err,
                    r.check.c_str(), ref_err, route_ms.topk_ms, route_ms.with_plan_ms, r.layer_ms,
                    static_cast<double>(r.workspace_bytes) / 1e6, r.timing.c_str(), check_ok ? "" : "  CHECK FAILED");
        jsonl << "{\"backend\":" << json_string(r.backend) << ",\"shape\":" << json_string(sh.name)
              << ",\"tokens\":" << tokens << ",\"E\":" << sh.e << ",\"k\":" << sh.k << ",\"H\":" << sh.h
              << ",\"I\":" << sh.i << ",\"weights\":" << json_string(fp8 ? "fp8" : "bf16")
              << ",\"ms\":" << json_number(r.ms) << ",\"floor_ms\":" << json_number(floor_ms)
              << ",\"fraction_of_floor\":" << json_number(frac) << ",\"tflops\":" << json_number(tflops)
              << ",\"gbps\":" << json_number(gbps) << ",\"max_rel_err\":" << json_number(r.max_rel_err)
              << ",\"check\":" << json_string(r.check) << ",\"ref_rel_err\":" << json_number(r.ref_rel_err)
              << ",\"routing_ms\":" << json_number(route_ms.topk_ms)
              << ",\"route_plan_ms\":" << json_number(route_ms.with_plan_ms)
              << ",\"layer_ms\":" << json_number(r.layer_ms)
              << ",\"workspace_bytes\":" << r.workspace_bytes << ",\"plan\":" << json_string(r.plan)
              << ",\"timing\":" << json_string(r.timing) << ",\"experts_touched\":" << json_number(touched)
              << ",\"bytes\":" << json_number(bytes) << ",\"flops\":" << json_number(flops) << "}\n";
      }
      jsonl.flush();
      std::fflush(stdout);
    }
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  std::printf("\nresults: %s (%.0f s), %d failed cell(s)\n", opt.out_path.c_str(), wall, failures);
  cudaStreamDestroy(s);
  return failures == 0 ? 0 : 1;
}

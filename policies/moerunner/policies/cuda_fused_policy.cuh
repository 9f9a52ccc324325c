// The `cuda_fused` backend, the default GPU policy: the runner core as a few CUDA
// kernels with tensor-core GEMMs, bf16 or f16 in, f32 accumulate.
//
// Pipeline, all on the caller's stream:
//   routing plan (device counts, offsets, slot order; -1 ids skipped) and the M-tile
//      schedule from the expert offsets, in the same kernel (one block at decode sizes)
//   -> GEMM1: rows gathered from x inside the load (no permuted copy), times w13[e]^T; each
//      CTA loads the gate rows and the up rows of the same columns (rows i and I+i, or 2i and
//      2i+1 with gate_up_layout interleaved), so its epilogue pairs gate column i with up column
//      i, adds b13 if given, applies the activation in f32 and writes act [R, I]
//      (apply_router_weight_on_input scales the f32 accumulators: act(W(w x)) = act(w (W x)))
//   -> GEMM2: act [R, I] times w2[e]^T; its epilogue adds b2 if given (one K range of a split
//      adds it), multiplies each row by its router weight
//      (unless applied on the input) and routed_scaling_factor (unless the weights carry it) and
//        - default: adds it into its token's output row with packed atomics (GEMM1 zeroed the
//          output; with inplace a memset does, after GEMM1 has read x). The order of the
//          additions per token varies from run to run, so the last bit may too; where GEMM2's
//          K is short and the slots many, rows and combine as below (measured faster);
//        - deterministic: writes rows [R, H], which combine_rows sums per token in slot order;
//        - no_combine: writes each row to its [token, slot] place in the output (deterministic).
//      At decode, where GEMM2's (M tile, N tile) items leave SMs idle, the wgmma GEMM2 also
//      splits K over more CTAs: their parts meet in the atomics, or (deterministic) are
//      written as f32 parts that combine_rows sums in split order.
// The GEMM grids are persistent and sized from M, k, E only, so no per-expert count ever
// reaches the host: no allocation and no host synchronization inside a run, which makes it
// CUDA-graph capturable. Every choice below is made once per run by gpu::make_fused_plan
// (gpu/fused_plan.hpp), which workspace_bytes reads too; plan(M) and describe(M) show it.
// The GEMM tuning follows the code the device runs (gpu::select_gemm_tuning): sm_90a code
// gets the wgmma + TMA kernels, other sm_90 code the mma.sync sm90 tuning, sm_80 code sm80.
// Where active experts average at most 4 rows (decode), sm_90a code runs the stream GEMMs
// instead: mma.sync with the weight rows as M, fed through warp-private cp.async rings, a
// CTA's warps splitting K; their weight copies are evict-first in L2 and, where a warp walks
// 16 or more K tiles, fetch 256 bytes at a time (set_stream_l2, gpu::stream_l2_use). Up to 64
// slots (M * k) no plan kernel runs then (unless set_plan_in_gemms(false)): every CTA of both
// GEMMs orders the rows and cuts the tiles itself from topk_ids in shared memory, exactly as
// the plan would (kernel_local_plan.cuh), and GEMM1's first CTA sets the error flag and, for
// the deterministic combine, writes the plan's slot_to_row. The wgmma kernels come with M
// tiles of 64 rows (two consumer warpgroups splitting the weight rows, five stages) where
// active experts average at most 64 rows; with 128-row tiles in pairs of CTAs that share each
// weight tile by TMA multicast where they average 512 or more, single 128-row tiles between;
// and with 64 x 128 tiles (one consumer warpgroup, eight stages) where GEMM1's 64 x 256 items
// would leave SMs idle (gpu::sm90_tile_for). set_gemm_tuning forces one (tests, benchmarks).
// set_narrow(true) runs narrow wgmma tiles instead where the tile is chosen by shape
// (sm90_kernel_grouped_gemm_wgmma_narrow.cuh): 256 weight rows as the wgmma's M and 8, 16 or
// 32 tokens as its N, so that a K tile's tensor work follows the tokens, fed by TMA weight boxes
// and one producer warp's token-row copies, summing K in the wide tiles' order; up to 64 slots
// they too build the schedule themselves.
// batch_invariant keeps every M on the wide wgmma tiles (whose K order does not depend on the
// tile) with no K split, GEMM2 writing rows that combine sums in slot order.
//
// Requirements, checked with a clear error before anything runs:
//   - hidden_states, w13 and w2 are all bf16 or all f16 (output: the same dtype); the optional
//     biases b13 and b2 are f32 or that dtype;
//   - hidden_size and intermediate_size are multiples of 8 (16-byte loads along K and
//     16-byte stores along N); within that any size works, multiples of the GEMM tiles or not;
//   - hidden_states, w13 and w2 start on 16-byte boundaries (cudaMalloc gives 256), and so
//     does the output unless deterministic is set with combining (GEMM2 stores into it);
//   - num_tokens * top_k fits in 32 bits.
// The workspace needs no particular alignment: run aligns its pieces itself.
// An expert id outside [-1, num_local_experts) counts as -1 (the slot contributes nothing), sets
// the routing plan's device-side error flag and is added to DispatchOutput::status when given
// (by the plan kernel, or by GEMM1's first CTA where the GEMMs build the schedule); rejecting it
// on the host would need a round trip, which a graph-capturable backend cannot make
// (cublas_grouped makes it and rejects).
//
// Known limits: at most gpu::plan_max_experts local experts (the routing plan's bound); the
// stream GEMMs run M tiles of 8 rows as one mma block (a tile with one token wastes 7/8 of
// its MMA work; the weight stream is what costs there).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/policies/cuda_fused_policy.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <cuda/stream_ref>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "moerunner/core/concepts.hpp"
#include "moerunner/core/config.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/gpu/combine.cuh"
#include "moerunner/gpu/down_store.cuh"
#include "moerunner/gpu/gather.cuh"
#include "moerunner/gpu/grouped_gemm.cuh"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/permute.cuh"
#include "moerunner/gpu/plan_schedule.cuh"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma.cuh"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma_narrow.cuh"
#include "moerunner/gpu/stream_gemm.cuh"
#include "moerunner/runner/validate.hpp"

namespace moerunner {

class cuda_fused_policy {
 public:
  static constexpr std::string_view name = "cuda_fused";
  static constexpr memory_space tensor_space = memory_space::device;
  using quant_infos = quant_info_list<unquantized_quant_info>;
  static constexpr bool graph_capturable = true;
  // Activations and weights are 16-bit; the workspace holds act and rows at this width.
  static constexpr std::size_t element_bytes = 2;
  // hidden_states, w13 and w2 are read with 16-byte cp.async copies.
  static constexpr std::size_t pointer_alignment = 16;
  // hidden_size and intermediate_size must be multiples of this (one 16-byte chunk of K).
  static constexpr int size_multiple = 8;

  explicit cuda_fused_policy(const MoeRunnerConfig& cfg) : cfg_(cfg) {}

  // Forces a GEMM tuning instead of the device's own (benchmarks, and tests that run the
  // sm80 tuning on a Hopper GPU); a tuning newer than the device is rejected at run time.
  void set_gemm_tuning(gpu::gemm_tuning_choice choice) noexcept { settings_.tuning = choice; }
  gpu::gemm_tuning_choice gemm_tuning() const noexcept { return settings_.tuning; }

  // Launch-order settings, for measuring them: the M tiles per raster band (0: the tuning's),
  // and whether the plan and the GEMMs are programmatic dependent launches. Unset, they are
  // with the stream GEMMs (measured 7% faster on Qwen3-30B-A3B at one token, within 0.4%
  // elsewhere) and not with the others (the plan and wgmma GEMMs measured 1-12% slower at
  // decode on an H200; bench/NOTES.md); the stream GEMMs' GEMM2 is GEMM1's dependent either way.
  void set_raster_band(int band) {
    MOE_EXPECT(band >= 0, "cuda_fused_policy::set_raster_band", "band must be 0 (the tuning's) or positive");
    raster_band_ = band;
  }
  void set_dependent_launch(bool on) noexcept { settings_.dependent_launch = on; }
  // Whether the decode GEMMs (stream, narrow) build the schedule themselves up to 64 slots
  // instead of the plan kernel (see the pipeline above). On by default: with the stream GEMMs
  // measured 12% faster on Qwen3-30B-A3B at one token, 1-4% at 8 tokens (bench/NOTES.md); off
  // runs the plan kernel (benchmarks, tests).
  void set_plan_in_gemms(bool on) noexcept { settings_.plan_in_gemms = on; }
  // Whether the wgmma GEMM1 loads A by TMA from x's rows gathered in plan order (M*k*H*2 more
  // workspace bytes) instead of gathering them itself by cp.async; unset, with the 128-row
  // tiles only (gpu::fused_plan::gather_a), for measuring it.
  void set_gather_a(std::optional<bool> on) noexcept { settings_.gather_a = on; }
  // Whether the wgmma GEMM2 loads its A rows (act, in plan order already) by TMA or by cp.async;
  // unset, by TMA (gpu::fused_plan::down_a_tma), for measuring one against the other.
  void set_down_a_tma(std::optional<bool> on) noexcept { settings_.down_a_tma = on; }
  // Whether the wgmma GEMMs hand their work items out at run time (each cluster asks for the
  // next as it starts one) instead of in fixed turns; unset, off (gpu::fused_plan::hand_out).
  void set_hand_out(std::optional<bool> on) noexcept { settings_.hand_out = on; }
  // Whether the wgmma GEMMs' raster bands are one expert's M tiles each (at most the raster
  // band) instead of fixed runs of tiles; unset, off (gpu::fused_plan::expert_bands).
  void set_expert_bands(std::optional<bool> on) noexcept { settings_.expert_bands = on; }
  // Whether the narrow decode tiles run where the tile is chosen by shape (never batch-invariant;
  // gpu::fused_settings::narrow); unset, off.
  void set_narrow(std::optional<bool> on) noexcept { settings_.narrow = on; }
  // Their tokens per tile (8, 16 or 32; unset: the smallest that holds the active experts'
  // average rows), for measuring; another count is refused by a plan that takes them.
  void set_narrow_tokens(std::optional<int> n) noexcept { settings_.narrow_tokens = n; }
  // The stream GEMMs' use of L2 (gpu::stream_l2_use; the defaults measured fastest), for
  // measuring it.
  void set_stream_l2(const gpu::stream_l2_use& use) {
    MOE_EXPECT(use.prefetch_bytes >= -1, "cuda_fused_policy::set_stream_l2",
               "prefetch_bytes must be -1 (half the L2) or a byte count");
    MOE_EXPECT(use.fetch_256_min_k_tiles >= 0, "cuda_fused_policy::set_stream_l2",
               "fetch_256_min_k_tiles must not be negative");
    stream_l2_ = use;
  }

  // Every choice a run over num_tokens tokens makes (kernel family, tile, cluster, K splits,
  // where GEMM2 stores, the workspace pieces), for the current device or a given one: the
  // single source of workspace_bytes and of the run. describe() is one line for a log.
  gpu::fused_plan plan(std::int64_t num_tokens) const {
    return plan(num_tokens, gpu::current_device_target_or_none());
  }
  gpu::fused_plan plan(std::int64_t num_tokens, const gpu::device_target& dev) const {
    return gpu::make_fused_plan(cfg_, settings_, num_tokens, dev);
  }
  std::string describe(std::int64_t num_tokens) const { return plan(num_tokens).describe(); }

  // Alignment slack + routing plan + M-tile schedule + act [M*k, I], each piece 256-byte
  // aligned, and when deterministic and combining the rows GEMM2 writes for combine: [M*k, H]
  // at 2 bytes, or where GEMM2 splits K at decode its f32 parts [splits, M*k, H]; at prefill
  // (128-row tiles) x's rows gathered in plan order for GEMM1's TMA loads, [M*k, H]. The split
  // count follows the device's SM count: a workspace sized for one device can be too small on
  // another (or under MIG), and the run then throws before anything runs; size it with the
  // target's overload for another device (gpu::device_target_of).
  std::size_t workspace_bytes(std::int64_t num_tokens) const { return plan(num_tokens).workspace.total; }
  std::size_t workspace_bytes(std::int64_t num_tokens, const gpu::device_target& dev) const {
    return plan(num_tokens, dev).workspace.total;
  }
  // The workspace every run of at most max_tokens tokens fits in: the need is not monotone in M
  // (gpu::max_plan_workspace). One plan per token count: a query for an engine's setup.
  std::size_t max_workspace_bytes(std::int64_t max_tokens) const {
    return max_workspace_bytes(max_tokens, gpu::current_device_target_or_none());
  }
  std::size_t max_workspace_bytes(std::int64_t max_tokens, const gpu::device_target& dev) const {
    return gpu::max_plan_workspace(
        cfg_, max_tokens, [&](std::int64_t m) { return plan(m, dev); }, "cuda_fused_policy::max_workspace_bytes");
  }

  CombineInput run_from_dispatch(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out,
                                 workspace_view ws, cuda::stream_ref stream_ref) {
    constexpr const char* where = "cuda_fused_policy";
    // The runner has checked these already; repeated so the policy is safe on its own.
    detail::validate_dispatch(cfg_, d, out, tensor_space, where);
    detail::validate_quant_info(cfg_, q, tensor_space, where);
    const dtype type = d.hidden_states.type;
    if (type != dtype::bf16 && type != dtype::f16)
      throw unsupported_error(std::string(where) + ": hidden_states must be bf16 or f16 (this backend runs " +
                              "16-bit tensor-core GEMMs), got " + std::string(dtype_name(type)));
    MOE_EXPECT(q.w13.type == type && q.w2.type == type, where,
               "w13 and w2 must have the dtype of hidden_states (" + std::string(dtype_name(type)) + "), got " +
                   std::string(dtype_name(q.w13.type)) + " and " + std::string(dtype_name(q.w2.type)));
    MOE_EXPECT(cfg_.hidden_size() % size_multiple == 0, where,
               "hidden_size must be a multiple of 8 (16-byte vector loads), got " +
                   std::to_string(cfg_.hidden_size()));
    MOE_EXPECT(cfg_.intermediate_size() % size_multiple == 0, where,
               "intermediate_size must be a multiple of 8 (16-byte vector loads), got " +
                   std::to_string(cfg_.intermediate_size()));
    check::aligned(d.hidden_states, pointer_alignment, where, "hidden_states");
    check::aligned(q.w13, pointer_alignment, where, "w13");
    check::aligned(q.w2, pointer_alignment, where, "w2");
    const std::int64_t m = d.num_tokens();
    MOE_EXPECT(m * cfg_.top_k() <= 0x7fffffff, where, "num_tokens * top_k must fit in 32 bits");
    const gpu::device_facts dev = gpu::current_device_facts();
    const gpu::fused_plan pl = plan(m, gpu::device_target_of(dev));
    detail::validate_workspace(pl.workspace.total, ws, where);
    if (pl.down != kernels::down_store::rows && pl.down != kernels::down_store::partials)
      MOE_EXPECT(reinterpret_cast<std::uintptr_t>(out.data) % pointer_alignment == 0, where,
                 "the output must be 16-byte aligned (GEMM2 stores into it; deterministic mode with combining "
                 "takes any alignment)");

    const CombineInput result{out, !cfg_.no_combine()};
    if (m == 0) return result;

    const int min_arch = gpu::gemm_tuning_min_arch(pl.choice);
    if (dev.code_arch < min_arch)
      throw unsupported_error(std::string(where) + ": GEMM tuning '" + std::string(gpu::gemm_tuning_name(pl.choice)) +
                              "' needs code compiled for sm_" + std::to_string(min_arch) +
                              " or newer; this device (sm_" + std::to_string(dev.arch) +
                              ") runs code compiled for sm_" + std::to_string(dev.code_arch));
    if (gpu::is_wgmma_choice(pl.choice) && !gpu::wgmma_gemm_available(dev))
      throw unsupported_error(std::string(where) + ": GEMM tuning '" + std::string(gpu::gemm_tuning_name(pl.choice)) +
                              "' needs code compiled for sm_90a; this device (sm_" + std::to_string(dev.arch) +
                              ") runs code compiled for sm_" + std::to_string(dev.code_arch) + " without it");

    const bool bf16 = type == dtype::bf16;
    const cudaStream_t s = stream_ref.get();
    switch (pl.family) {
      case gpu::gemm_family::stream:
        if (pl.tile == gpu::sm90_tile::stream_ordered)
          run_pipeline<gpu::stream_gemm_ordered_policy>(bf16, d, q, out, ws, pl, dev, s);
        else run_pipeline<gpu::stream_gemm_policy>(bf16, d, q, out, ws, pl, dev, s);
        break;
      case gpu::gemm_family::wgmma:
        switch (pl.tile) {
          case gpu::sm90_tile::m64:
            if (pl.down_tile == gpu::sm90_tile::m64n128)
              run_pipeline<gpu::sm90_wgmma_m64_gemm_policy, gpu::sm90_wgmma_m64n128_gemm_policy>(bf16, d, q, out, ws,
                                                                                                  pl, dev, s);
            else run_pipeline<gpu::sm90_wgmma_m64_gemm_policy>(bf16, d, q, out, ws, pl, dev, s);
            break;
          case gpu::sm90_tile::m64n128:
            run_pipeline<gpu::sm90_wgmma_m64n128_gemm_policy>(bf16, d, q, out, ws, pl, dev, s);
            break;
          case gpu::sm90_tile::m128x2:
            run_pipeline<gpu::sm90_wgmma_m128x2_gemm_policy>(bf16, d, q, out, ws, pl, dev, s);
            break;
          case gpu::sm90_tile::narrow:
            gpu::with_narrow_tokens(pl.schedule_block_m, [&]<int N>() {
              run_pipeline<gpu::sm90_wgmma_narrow_gemm_policy<N>>(bf16, d, q, out, ws, pl, dev, s);
            });
            break;
          default: run_pipeline<gpu::sm90_wgmma_gemm_policy>(bf16, d, q, out, ws, pl, dev, s); break;
        }
        break;
      case gpu::gemm_family::mma:
        if (pl.choice == gpu::gemm_tuning_choice::sm90) run_pipeline<gpu::sm90_gemm_policy>(bf16, d, q, out, ws, pl, dev, s);
        else run_pipeline<gpu::sm80_gemm_policy>(bf16, d, q, out, ws, pl, dev, s);
        break;
    }
    return result;
  }

 private:
  static constexpr std::size_t piece_alignment = gpu::plan_piece_alignment;

  // M tiles per raster band: the tuning's unless set (bands of 8 measured as fast as N-fastest
  // order or faster on every benchmark cell, up to 1.2x where experts have many M tiles).
  template <class GemmPolicy>
  int raster_band() const {
    return raster_band_ > 0 ? raster_band_ : GemmPolicy::tuning.raster_band;
  }

  // `dependent`: launch as a programmatic dependent of the kernel before it (wgmma and stream
  // GEMMs; the mma.sync kernel has no such launch).
  template <class T, class GemmPolicy, kernels::moe_gemm_kind Kind>
  void launch_gemm(const kernels::moe_gemm_params<T>& g, const gpu::tile_schedule& schedule,
                   const gpu::device_facts& dev, cudaStream_t stream, bool dependent) const {
    kernels::moe_gemm_params<T> p = g;
    p.raster_band = raster_band<GemmPolicy>();
    using tuning_t = std::remove_cv_t<decltype(GemmPolicy::tuning)>;
    if constexpr (std::is_same_v<tuning_t, gpu::wgmma_gemm_tuning>)
      gpu::launch_moe_gemm_wgmma<T, Kind, GemmPolicy>(p, cfg_.num_local_experts(), schedule, dev, stream,
                                                      dependent);
    else if constexpr (std::is_same_v<tuning_t, gpu::wgmma_narrow_tuning>)
      gpu::launch_moe_gemm_wgmma_narrow<T, Kind, GemmPolicy::tuning.block_m>(p, cfg_.num_local_experts(), schedule,
                                                                            dev, stream, dependent);
    else if constexpr (std::is_same_v<tuning_t, gpu::stream_gemm_tuning>)
      gpu::launch_moe_stream_gemm<T, GemmPolicy, Kind>(p, schedule, dev, stream, dependent);
    else gpu::launch_moe_gemm<T, GemmPolicy, Kind>(p, schedule, dev, stream);
  }

  // The pipeline with the element type the run's dtype names (bf16 or, validated, f16); GEMM2 on
  // DownPolicy's tile (the plan's down_tile).
  template <class GemmPolicy, class DownPolicy = GemmPolicy, class... Args>
  void run_pipeline(bool bf16, Args&&... args) {
    if (bf16) run_pipeline_as<__nv_bfloat16, GemmPolicy, DownPolicy>(std::forward<Args>(args)...);
    else run_pipeline_as<__half, GemmPolicy, DownPolicy>(std::forward<Args>(args)...);
  }

  template <class T, class GemmPolicy, class DownPolicy>
  void run_pipeline_as(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out,
                       workspace_view ws, const gpu::fused_plan& pl, const gpu::device_facts& dev,
                       cudaStream_t stream) {
    constexpr auto tuning = GemmPolicy::tuning;
    static_assert(tuning.schedule_block_m() >= gpu::moe_gemm_min_block_m,
                  "the workspace sizes the M-tile schedule for the smallest tile");
    static_assert(DownPolicy::tuning.schedule_block_m() == tuning.schedule_block_m(),
                  "both GEMMs walk one M-tile schedule");
    constexpr bool stream_gemm = std::is_same_v<std::remove_cv_t<decltype(tuning)>, gpu::stream_gemm_tuning>;
    MOE_EXPECT(tuning.schedule_block_m() == pl.schedule_block_m, "cuda_fused_policy",
               "internal: the plan's schedule tile does not match the kernel it runs");
    const bool dependent = pl.dependent_launch;
    const gpu::fused_workspace& lay = pl.workspace;
    const std::int64_t m = d.num_tokens();
    const int k = cfg_.top_k(), hidden = cfg_.hidden_size(), inter = cfg_.intermediate_size();
    const std::int64_t slots = m * k;
    auto start = reinterpret_cast<std::uintptr_t>(ws.data);
    start = (start + piece_alignment - 1) / piece_alignment * piece_alignment;
    char* base = reinterpret_cast<char*>(start);

    // The stream GEMMs may build the schedule in each CTA from topk_ids (no plan kernel); GEMM1
    // then writes slot_to_row when combine reads it (deterministic).
    const bool schedule_in_gemms = pl.schedule_in_gemms;
    gpu::routing_plan plan;
    gpu::tile_schedule schedule;
    if (schedule_in_gemms) {
      // The GEMMs write the plan: only its pieces are carved here (the ids and workspace checked).
      plan = gpu::carve_routing_plan(d.topk.topk_ids, cfg_.num_local_experts(), base + lay.plan, lay.plan_bytes,
                                     "cuda_fused_policy");
      schedule.capacity = gpu::moe_m_tile_capacity(slots, cfg_.num_local_experts(), tuning.schedule_block_m());
      schedule.block_m = tuning.schedule_block_m();
    } else {
      const gpu::plan_and_schedule built = gpu::build_routing_plan_and_schedule(
          d.topk.topk_ids, cfg_.num_local_experts(), tuning.schedule_block_m(), base + lay.plan, lay.plan_bytes,
          base + lay.schedule, lay.schedule_bytes, stream, dependent, d.status,
          pl.expert_bands ? raster_band<GemmPolicy>() : 0);
      plan = built.plan;
      schedule = built.schedule;
    }
    T* act = reinterpret_cast<T*>(base + lay.act);
    const float* weights = d.topk.topk_weights.ptr<const float>();
    // GEMM1 zeroes what GEMM2 adds into (accumulate), or the slots no row reaches (no_combine);
    // an output that aliases x (inplace) is zeroed only once GEMM1 has read x.
    const bool clear_in_gemm1 = pl.clear_in_gemm1;

    kernels::moe_gemm_params<T> g1{};
    g1.a = d.hidden_states.ptr<const T>();
    if (pl.gather_a) {
      // x's rows in plan order, for GEMM1's TMA loads (a plain launch: the plan comes before).
      void* gathered = base + lay.gathered;
      gpu::gather_rows(d.hidden_states, plan, gathered, stream);
      g1.a = static_cast<const T*>(gathered);
      g1.a_gathered = true;
      g1.a_rows = slots;
    }
    g1.row_to_slot = plan.row_to_slot;
    g1.top_k = k;
    g1.b = q.w13.ptr<const T>();
    g1.b_rows_per_expert = cfg_.w13_rows();
    g1.n = inter;
    g1.k = hidden;
    g1.c = act;
    g1.input_weights = cfg_.apply_router_weight_on_input() ? weights : nullptr;
    g1.act = cfg_.act();
    g1.interleaved = cfg_.gate_up_layout() == w13_layout::interleaved;
    g1.bias = q.b13.data;
    g1.bias_f32 = q.b13.type == dtype::f32;
    if (clear_in_gemm1) {
      g1.clear = static_cast<uint4*>(out.data);
      g1.clear_vectors = static_cast<std::int64_t>(out.bytes() / sizeof(uint4));  // H % 8 == 0: whole vectors
    }
    if (schedule_in_gemms) {
      g1.local_ids = d.topk.topk_ids.ptr<const std::int32_t>();
      g1.local_slots = static_cast<int>(slots);
      g1.local_experts = cfg_.num_local_experts();
      g1.local_error = plan.error_flag;
      g1.local_status = d.status;
      if (pl.combine_kernel || pl.combine_in_gemm2) g1.local_slot_to_row = plan.slot_to_row;
    }
    const float scale = d.topk.routed_scaling_applied ? 1.0f : cfg_.routed_scaling_factor();
    const float* row_weights = cfg_.apply_router_weight_on_input() ? nullptr : weights;
    kernels::moe_gemm_params<T> g2{};
    g2.a = act;
    g2.a_gathered = pl.down_a_tma;  // act's rows are in plan order: TMA boxes need no gather
    g2.a_rows = slots;
    g2.row_to_slot = plan.row_to_slot;
    g2.top_k = k;
    g2.b = q.w2.ptr<const T>();
    g2.b_rows_per_expert = hidden;
    g2.n = hidden;
    g2.k = inter;
    g2.act = cfg_.act();
    g2.bias = q.b2.data;
    g2.bias_f32 = q.b2.type == dtype::f32;
    g2.k_splits = pl.down_k_splits;
    g2.local_ids = g1.local_ids;
    g2.local_slots = g1.local_slots;
    g2.local_experts = g1.local_experts;
    if (pl.hand_out) {
      g1.item_counter = schedule.item_counters;
      g2.item_counter = schedule.item_counters + 1;
    }
    g1.expert_bands = g2.expert_bands = pl.expert_bands;
    // Deterministic split-K: f32 parts per split, summed in split order by combine.
    gpu::set_down_store(g2, pl.down, base + lay.rows, slots, out, row_weights, scale);
    if (pl.combine_in_gemm2) {
      // GEMM2's last CTA of each N tile combines (kernel_stream_gemm.cuh); GEMM1 zeroes the counts.
      auto* strips = reinterpret_cast<std::int32_t*>(base + lay.strips);
      g2.combine = {strips, out.ptr<T>(), plan.slot_to_row, row_weights, scale, static_cast<int>(m)};
      MOE_EXPECT(!clear_in_gemm1, "cuda_fused_policy", "internal: GEMM1 clears either the output or the counts");
      g1.clear = reinterpret_cast<uint4*>(strips);
      g1.clear_vectors = static_cast<std::int64_t>(lay.strips_bytes / sizeof(uint4));
    }
    if constexpr (stream_gemm) {
      g1.next = gpu::stream_next_gemm<T, GemmPolicy>(g2, schedule, dev, stream_l2_);
      g1.weights_evict_first = g2.weights_evict_first = stream_l2_.evict_first;
      g1.weights_fetch_256 = gpu::stream_fetch_256<GemmPolicy>(stream_l2_, g1.k);
      g2.weights_fetch_256 = gpu::stream_fetch_256<GemmPolicy>(stream_l2_, g2.k);
    }
    if (cfg_.is_gated())
      launch_gemm<T, GemmPolicy, kernels::moe_gemm_kind::gate_up>(g1, schedule, dev, stream, dependent);
    else launch_gemm<T, GemmPolicy, kernels::moe_gemm_kind::up_only>(g1, schedule, dev, stream, dependent);
    const bool memset_between = pl.memset_between;
    if (memset_between) MOE_CUDA_CHECK(cudaMemsetAsync(out.data, 0, out.bytes(), stream));

    // The stream GEMM2 loads its first weights while GEMM1 drains (kernel_stream_gemm.cuh), so
    // it is always GEMM1's programmatic dependent. After the inplace memset it is a plain
    // launch whatever was asked: a programmatic launch overlaps kernels, not a memset.
    launch_gemm<T, DownPolicy, kernels::moe_gemm_kind::down>(g2, schedule, dev, stream,
                                                             (dependent || stream_gemm) && !memset_between);

    // Deterministic: combine sums the rows, launched as GEMM2's programmatic dependent when the
    // GEMMs are launched so (by default with the stream GEMMs), unless GEMM2 did.
    if (pl.combine_kernel) gpu::combine_down(g2, plan, row_weights, scale, out, stream, dependent);
  }

  MoeRunnerConfig cfg_;
  int raster_band_ = 0;
  gpu::fused_settings settings_;
  gpu::stream_l2_use stream_l2_;
};

static_assert(explain_dispatch_runner_core<cuda_fused_policy>());
static_assert(!std::is_polymorphic_v<cuda_fused_policy>);

}  // namespace moerunner

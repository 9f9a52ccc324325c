// The `cuda_fused_fp8` backend: the runner core in fp8 e4m3 on Hopper (sm_90a only), for the
// three fp8 weight formats: 128 x 128 block scales (DeepSeek-V3's, fp8_block_quant_info), one
// scale per expert matrix (fp8_tensor_quant_info) or per output channel (fp8_channel_quant_info).
//
// Pipeline, all on the caller's stream, nothing on the host in between (CUDA-graph capturable):
//   routing plan and M-tile schedule (the plan kernel, as cuda_fused): tiles of 64 rows, or of
//      128 for pairs of CTAs sharing each weight tile where experts average at least 96 rows
//      (or for 128-row CTAs, on request: set_tall); the 64-row CTAs run the overlapped K loop
//      (K tile kt + 1's wgmma queued while kt's sums are promoted), or the one set_k_loop asks
//      for (gpu::fp8_k_loop)
//   -> the input rows quantized per token in groups of 128 into the workspace (e4m3 + an f32
//      scale per group), unless hidden_states come as e4m3 with hidden_scales
//   -> GEMM1: e4m3 x rows gathered inside the load, times w13[e]^T on fp8 wgmma, each 128-K
//      block's sum added into f32 times its row's x scale and the weight block's (or the
//      matrix's) scale; per channel, the epilogue multiplies each column by its scale instead;
//      the epilogue pairs gate and up columns, applies the activation in f32 (the router weight
//      first where applied on the input) and writes act as e4m3 with one scale per row and 128
//      columns
//   -> GEMM2: e4m3 act (its rows loaded by TMA, as they are in plan order) times w2[e]^T,
//      scaled alike; rows into the output by vector reductions,
//      or (deterministic, batch-invariant, or short I with many slots) rows that a combine
//      kernel sums in slot order, or (no_combine) each row to its [token, slot] place; where
//      its items are few GEMM2 also splits K.
// At decode (active experts average at most 8 rows, not batch-invariant) both GEMMs run narrow
// tiles instead (sm90_kernel_grouped_gemm_wgmma_narrow.cuh): 256 weight rows as the wgmma's
// M and the schedule tile's 8, 16 or 32 tokens as its N, the same per-128-K promotion, the
// epilogues through an f32 staging tile (GEMM1 quantizes act per token and 128 columns there);
// where asked (set_schedule_in_gemms) every CTA orders the rows itself up to 64 slots (no plan
// kernel).
// Where asked (set_stream_gemms) the stream GEMMs on e4m3 instead (kernel_stream_gemm.cuh,
// mma.sync m16n8k32 with the same promotion): up to 64 slots they order the rows themselves (no
// plan kernel), GEMM1 writes f32 act that the input rows' quantizer turns into e4m3 + scales
// (its 128-column groups span several of GEMM1's CTAs), and each kernel is its predecessor's
// programmatic dependent.
// gpu::make_fp8_plan makes every choice, once per run.
// The quantization points and rule are the reference's (the fp8 methods on `reference`), so
// the two agree to the fp8 rounding of values the GEMMs compute in a different order.
//
// Requirements, checked with a clear error before anything runs: w13 and w2 e4m3 with f32
// scales of the format's shape on the device; hidden_states bf16 or f16 (output: the same) or
// e4m3 with hidden_scales [M, H/128] (output: bf16); hidden_size and intermediate_size multiples
// of 128; hidden_states, w13 and w2 16-byte aligned, the scales 4-byte, the output 16-byte
// unless GEMM2 writes rows; an sm_90a image on the device. Expert ids outside
// [-1, num_local_experts) count as -1 and are reported as cuda_fused reports them (the routing
// plan's flag, DispatchOutput::status). No biases (the formats have none).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/policies/cuda_fused_fp8_policy.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

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
#include "moerunner/gpu/fp8_plan.hpp"
#include "moerunner/gpu/plan_schedule.cuh"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma.cuh"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma_fp8.cuh"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma_narrow.cuh"
#include "moerunner/gpu/stream_gemm.cuh"
#include "moerunner/runner/validate.hpp"

namespace moerunner {

class cuda_fused_fp8_policy {
 public:
  static constexpr std::string_view name = "cuda_fused_fp8";
  static constexpr memory_space tensor_space = memory_space::device;
  using quant_infos = quant_info_list<fp8_block_quant_info, fp8_tensor_quant_info, fp8_channel_quant_info>;
  static constexpr bool graph_capturable = true;
  static constexpr std::size_t pointer_alignment = 16;

  explicit cuda_fused_fp8_policy(const MoeRunnerConfig& cfg) : cfg_(cfg) {}

  // Every choice of a run over num_tokens tokens (the single source of workspace_bytes and run),
  // for the current device or a given one; describe() is one line for a log.
  gpu::fp8_plan plan(std::int64_t num_tokens) const { return plan(num_tokens, gpu::current_device_target_or_none()); }
  gpu::fp8_plan plan(std::int64_t num_tokens, const gpu::device_target& dev) const {
    return gpu::make_fp8_plan(cfg_, num_tokens, dev, settings_);
  }
  // Force the stream GEMMs, pairs or fours of wgmma CTAs or 128-row wgmma CTAs on or off, the wgmma
  // GEMMs' K loop or raster band (or bands of one expert's tiles), their work items handed out at
  // run time, GEMM2's K splits, its rows for the combine kernel against its reductions into the
  // output, its A rows by TMA against cp.async, its sums stored by store warps, dependent launches
  // of the GEMMs, GEMM1's K splits, GEMM1's act quantized by store warps, the narrow decode
  // tiles, their tokens per tile or the decode GEMMs' own schedule (unset: the plan's rules), for
  // measuring one against the other (gpu::fp8_settings).
  // set_settings forces them all at once (what it leaves unset, the rules decide).
  void set_settings(const gpu::fp8_settings& forced) noexcept { settings_ = forced; }
  void set_stream_gemms(std::optional<bool> on) noexcept { settings_.stream = on; }
  void set_pairs(std::optional<bool> on) noexcept { settings_.pairs = on; }
  void set_quads(std::optional<bool> on) noexcept { settings_.quads = on; }
  void set_tall(std::optional<bool> on) noexcept { settings_.tall = on; }
  void set_k_loop(std::optional<gpu::fp8_k_loop> loop) noexcept { settings_.k_loop = loop; }
  void set_hand_out(std::optional<bool> on) noexcept { settings_.hand_out = on; }
  // (A band or a split count below 1 is refused by the plan, so by the next plan, workspace_bytes
  // or run.)
  void set_raster_band(std::optional<int> band) noexcept { settings_.raster_band = band; }
  void set_down_k_splits(std::optional<int> splits) noexcept { settings_.down_k_splits = splits; }
  void set_up_k_splits(std::optional<int> splits) noexcept { settings_.up_k_splits = splits; }
  void set_staged_up(std::optional<bool> on) noexcept { settings_.staged_up = on; }
  void set_expert_bands(std::optional<bool> on) noexcept { settings_.expert_bands = on; }
  void set_down_rows(std::optional<bool> on) noexcept { settings_.down_rows = on; }
  void set_down_a_tma(std::optional<bool> on) noexcept { settings_.down_a_tma = on; }
  void set_staged_down(std::optional<bool> on) noexcept { settings_.staged_down = on; }
  void set_dependent_gemms(std::optional<bool> on) noexcept { settings_.dependent_gemms = on; }
  void set_narrow(std::optional<bool> on) noexcept { settings_.narrow = on; }
  void set_schedule_in_gemms(std::optional<bool> on) noexcept { settings_.schedule_in_gemms = on; }
  void set_narrow_tokens(std::optional<int> n) noexcept { settings_.narrow_tokens = n; }
  std::string describe(std::int64_t num_tokens) const { return plan(num_tokens).describe(); }

  // Alignment slack + routing plan + schedule + x in e4m3 with its scales + act in e4m3 with its
  // scales (+ GEMM2's rows or K-split parts when a combine kernel sums them; + the stream GEMM1's
  // f32 act, or GEMM1's K-split parts where set_up_k_splits asks for them). The split count
  // follows the device's SM count: size a workspace for another device with its target.
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
        cfg_, max_tokens, [&](std::int64_t m) { return plan(m, dev); }, "cuda_fused_fp8_policy::max_workspace_bytes");
  }

  template <fp8_weight_format Q>
  CombineInput run_from_dispatch(const DispatchOutput& d, const Q& q, const tensor_view& out, workspace_view ws,
                                 cuda::stream_ref stream_ref) {
    constexpr const char* where = "cuda_fused_fp8_policy";
    detail::validate_dispatch(cfg_, d, out, tensor_space, where);
    detail::validate_quant_info(cfg_, q, tensor_space, where);
    const dtype type = d.hidden_states.type;
    if (type != dtype::bf16 && type != dtype::f16 && type != dtype::f8_e4m3)
      throw unsupported_error(std::string(where) + ": hidden_states must be bf16, f16 or f8_e4m3 with hidden_scales, got " +
                              std::string(dtype_name(type)));
    if (cfg_.hidden_size() % gpu::fp8_group_size != 0 || cfg_.intermediate_size() % gpu::fp8_group_size != 0)
      throw unsupported_error(std::string(where) + ": hidden_size and intermediate_size must be multiples of 128 (the "
                              "scale blocks), got " + std::to_string(cfg_.hidden_size()) + " and " +
                              std::to_string(cfg_.intermediate_size()));
    check::aligned(d.hidden_states, pointer_alignment, where, "hidden_states");
    check::aligned(q.w13, pointer_alignment, where, "w13");
    check::aligned(q.w2, pointer_alignment, where, "w2");
    // Scales are copied 4 bytes at a time.
    check::aligned(q.w13_scale, sizeof(float), where, "w13_scale");
    check::aligned(q.w2_scale, sizeof(float), where, "w2_scale");
    if (type == dtype::f8_e4m3) check::aligned(d.hidden_scales, sizeof(float), where, "hidden_scales");
    const std::int64_t m = d.num_tokens();
    MOE_EXPECT(m * cfg_.top_k() <= 0x7fffffff, where, "num_tokens * top_k must fit in 32 bits");
    const gpu::device_facts dev = gpu::current_device_facts();
    const gpu::fp8_plan pl = plan(m, gpu::device_target_of(dev));
    detail::validate_workspace(pl.workspace.total, ws, where);
    if (!pl.combine_kernel)
      MOE_EXPECT(reinterpret_cast<std::uintptr_t>(out.data) % pointer_alignment == 0, where,
                 "the output must be 16-byte aligned (GEMM2 stores into it; deterministic mode with combining "
                 "takes any alignment)");
    const CombineInput result{out, !cfg_.no_combine()};
    if (m == 0) return result;
    if (!gpu::wgmma_gemm_available(dev))
      throw unsupported_error(std::string(where) + ": fp8 GEMMs need code compiled for sm_90a; this device (sm_" +
                              std::to_string(dev.arch) + ") runs code compiled for sm_" + std::to_string(dev.code_arch) +
                              " without it");
    const fp8_weights w{static_cast<const std::uint8_t*>(q.w13.data), static_cast<const float*>(q.w13_scale.data),
                        static_cast<const std::uint8_t*>(q.w2.data), static_cast<const float*>(q.w2_scale.data),
                        Q::scaling};
    if (out.type == dtype::bf16) run_as<__nv_bfloat16>(d, w, out, ws, pl, dev, stream_ref.get());
    else run_as<__half>(d, w, out, ws, pl, dev, stream_ref.get());
    return result;
  }

 private:
  // The three formats differ only in how the kernels read the scales: one run_as for all.
  struct fp8_weights {
    const std::uint8_t* w13;
    const float* w13_scale;
    const std::uint8_t* w2;
    const float* w2_scale;
    fp8_weight_scaling scaling;
  };

  template <class T>
  void run_as(const DispatchOutput& d, const fp8_weights& q, const tensor_view& out, workspace_view ws,
              const gpu::fp8_plan& pl, const gpu::device_facts& dev, cudaStream_t stream) {
    using kernels::moe_gemm_kind;
    const gpu::fp8_workspace& lay = pl.workspace;
    const std::int64_t m = d.num_tokens();
    const int k = cfg_.top_k(), hidden = cfg_.hidden_size(), inter = cfg_.intermediate_size();
    const std::int64_t slots = m * k;
    auto start = reinterpret_cast<std::uintptr_t>(ws.data);
    start = (start + gpu::plan_piece_alignment - 1) / gpu::plan_piece_alignment * gpu::plan_piece_alignment;
    char* base = reinterpret_cast<char*>(start);

    // At decode the stream GEMMs and the narrow tiles may order the rows themselves (no plan
    // kernel): only the plan's pieces are carved here, and GEMM1's first CTA writes the error
    // flag, status and slot_to_row.
    const int experts = cfg_.num_local_experts();
    gpu::routing_plan plan;
    gpu::tile_schedule schedule;
    if (pl.schedule_in_gemms) {
      plan = gpu::carve_routing_plan(d.topk.topk_ids, experts, base + lay.plan, lay.plan_bytes, "cuda_fused_fp8_policy");
      schedule.capacity = gpu::moe_m_tile_capacity(slots, experts, pl.schedule_block_m);
      schedule.block_m = pl.schedule_block_m;
    } else {
      const gpu::plan_and_schedule built = gpu::build_routing_plan_and_schedule(
          d.topk.topk_ids, experts, pl.schedule_block_m, base + lay.plan, lay.plan_bytes, base + lay.schedule,
          lay.schedule_bytes, stream, false, d.status, pl.expert_bands ? pl.raster_band : 0);
      plan = built.plan;
      schedule = built.schedule;
    }
    // The stream kernels follow one another by programmatic launches (each waits for the one
    // before it before reading what it wrote).
    const bool dependent = pl.stream;

    const std::uint8_t* x_q = nullptr;
    const float* x_scale = nullptr;
    if (d.hidden_states.type == dtype::f8_e4m3) {
      x_q = d.hidden_states.ptr<const std::uint8_t>();
      x_scale = d.hidden_scales.ptr<const float>();
    } else {
      auto* q8 = reinterpret_cast<std::uint8_t*>(base + lay.x_q);
      auto* s = reinterpret_cast<float*>(base + lay.x_scale);
      gpu::quantize_rows_fp8(d.hidden_states.ptr<const T>(), m, hidden, q8, s, stream, dependent);
      x_q = q8;
      x_scale = s;
    }
    auto* act = reinterpret_cast<std::uint8_t*>(base + lay.act);
    auto* act_scale = reinterpret_cast<float*>(base + lay.act_scale);
    const float* weights = d.topk.topk_weights.ptr<const float>();

    kernels::moe_gemm_fp8_params<T> g1{};
    g1.g.row_to_slot = plan.row_to_slot;
    g1.g.top_k = k;
    g1.g.b_rows_per_expert = cfg_.w13_rows();
    g1.g.n = inter;
    g1.g.k = hidden;
    g1.g.input_weights = cfg_.apply_router_weight_on_input() ? weights : nullptr;
    g1.g.act = cfg_.act();
    g1.g.interleaved = cfg_.gate_up_layout() == w13_layout::interleaved;
    g1.g.raster_band = pl.raster_band;
    if (pl.clear_in_gemm1) {
      g1.g.clear = static_cast<uint4*>(out.data);
      g1.g.clear_vectors = static_cast<std::int64_t>(out.bytes() / sizeof(uint4));  // H % 128 == 0: whole vectors
    }
    g1.a = x_q;
    g1.a_scale = x_scale;
    g1.b_scale = q.w13_scale;
    g1.b_scaling = q.scaling;
    g1.act = act;
    g1.act_scale = act_scale;
    if (pl.up_k_splits > 1) {
      g1.g.k_splits = pl.up_k_splits;
      g1.up_parts = reinterpret_cast<float*>(base + lay.up_parts);
      g1.up_parts_stride = slots * (cfg_.is_gated() ? 2 : 1) * static_cast<std::int64_t>(inter);
    }
    if (pl.schedule_in_gemms) {
      g1.g.local_ids = d.topk.topk_ids.ptr<const std::int32_t>();
      g1.g.local_slots = static_cast<int>(slots);
      g1.g.local_experts = experts;
      g1.g.local_error = plan.error_flag;
      g1.g.local_status = d.status;
      if (pl.combine_kernel) g1.g.local_slot_to_row = plan.slot_to_row;
    }

    const float scale = d.topk.routed_scaling_applied ? 1.0f : cfg_.routed_scaling_factor();
    const float* row_weights = cfg_.apply_router_weight_on_input() ? nullptr : weights;
    kernels::moe_gemm_fp8_params<T> g2{};
    g2.g.row_to_slot = plan.row_to_slot;
    g2.g.top_k = k;
    g2.g.b_rows_per_expert = hidden;
    g2.g.n = hidden;
    g2.g.k = inter;
    g2.g.act = cfg_.act();
    g2.g.raster_band = pl.raster_band;
    g2.g.k_splits = pl.down_k_splits;
    gpu::set_down_store(g2.g, pl.down, base + lay.rows, slots, out, row_weights, scale);
    g2.a = act;
    g2.a_scale = act_scale;
    g2.a_tma = pl.down_a_tma;
    g2.g.a_rows = slots;
    g2.b_scale = q.w2_scale;
    g2.b_scaling = q.scaling;
    g2.g.local_ids = g1.g.local_ids;
    g2.g.local_slots = g1.g.local_slots;
    g2.g.local_experts = g1.g.local_experts;

    if (pl.hand_out) {
      g1.g.item_counter = schedule.item_counters;
      g2.g.item_counter = schedule.item_counters + 1;
    }
    g1.g.expert_bands = g2.g.expert_bands = pl.expert_bands;
    if (pl.stream) {
      run_stream(g1, g2, q, pl, schedule, base, dev, stream);
    } else {
      const std::uint8_t* w13 = q.w13;
      const std::uint8_t* w2 = q.w2;
      // Dependent launches (where the plan asks) only after a kernel that comes after the plan
      // kernel: the GEMMs read the schedule before their wait (load_first_weights).
      const bool gemm1_dependent = pl.dependent_gemms && d.hidden_states.type != dtype::f8_e4m3;
      const bool gemm2_dependent = pl.dependent_gemms;
      // Store warps where the plan takes them (64-row CTAs alone or in pairs: GEMM1 where gated,
      // GEMM2), with the plain K loop whatever the other GEMM's.
      const auto gemm1 = [&]<int Cluster, int BlockM, gpu::fp8_k_loop Loop>() {
        if constexpr (BlockM == gpu::fp8_block_m && Cluster <= 2) {
          if (pl.staged_up) {
            gpu::launch_moe_gemm_wgmma_fp8<T, moe_gemm_kind::gate_up, Cluster, BlockM, gpu::fp8_k_loop::plain, true>(
                g1, w13, experts, schedule, dev, stream, gemm1_dependent);
            return;
          }
        }
        if (cfg_.is_gated())
          gpu::launch_moe_gemm_wgmma_fp8<T, moe_gemm_kind::gate_up, Cluster, BlockM, Loop>(
              g1, w13, experts, schedule, dev, stream, gemm1_dependent);
        else
          gpu::launch_moe_gemm_wgmma_fp8<T, moe_gemm_kind::up_only, Cluster, BlockM, Loop>(
              g1, w13, experts, schedule, dev, stream, gemm1_dependent);
      };
      const auto gemms = [&]<int Cluster, int BlockM, gpu::fp8_k_loop Loop>() {
        gemm1.template operator()<Cluster, BlockM, Loop>();
        if (pl.up_k_splits > 1) gpu::finish_up_parts_fp8(g1, cfg_.is_gated(), schedule, stream);
        if constexpr (BlockM == gpu::fp8_block_m && Cluster <= 2) {
          if (pl.staged_down) {
            gpu::launch_moe_gemm_wgmma_fp8<T, moe_gemm_kind::down, Cluster, BlockM, gpu::fp8_k_loop::plain, true>(
                g2, w2, experts, schedule, dev, stream, gemm2_dependent);
            return;
          }
        }
        gpu::launch_moe_gemm_wgmma_fp8<T, moe_gemm_kind::down, Cluster, BlockM, Loop>(g2, w2, experts, schedule, dev,
                                                                                        stream, gemm2_dependent);
      };
      // 64-row CTAs alone or in pairs, with the plan's K loop; in fours and 128-row CTAs with the
      // plain one.
      const auto m64 = [&]<int Cluster>() {
        using gpu::fp8_k_loop;
        constexpr int bm = gpu::fp8_block_m;
        switch (pl.k_loop) {
          case fp8_k_loop::overlap: gemms.template operator()<Cluster, bm, fp8_k_loop::overlap>(); break;
          case fp8_k_loop::stagger: gemms.template operator()<Cluster, bm, fp8_k_loop::stagger>(); break;
          default: gemms.template operator()<Cluster, bm, fp8_k_loop::plain>();
        }
      };
      // Narrow tiles: both GEMMs on the plan's N tokens per tile.
      const auto narrow = [&]<int N>() {
        if (cfg_.is_gated())
          gpu::launch_moe_gemm_wgmma_narrow<T, moe_gemm_kind::gate_up, N>(g1, w13, experts, schedule, dev, stream,
                                                                              gemm1_dependent);
        else
          gpu::launch_moe_gemm_wgmma_narrow<T, moe_gemm_kind::up_only, N>(g1, w13, experts, schedule, dev, stream,
                                                                              gemm1_dependent);
        gpu::launch_moe_gemm_wgmma_narrow<T, moe_gemm_kind::down, N>(g2, w2, experts, schedule, dev, stream,
                                                                         gemm2_dependent);
      };
      switch (pl.tile) {
        case gpu::fp8_tile::narrow:
          gpu::with_narrow_tokens(pl.schedule_block_m, narrow);
          break;
        case gpu::fp8_tile::m64x2: m64.template operator()<2>(); break;
        case gpu::fp8_tile::m64x4: gemms.template operator()<4, gpu::fp8_block_m, gpu::fp8_k_loop::plain>(); break;
        case gpu::fp8_tile::m128:
          gemms.template operator()<1, gpu::fp8_large_block_m, gpu::fp8_k_loop::plain>();
          break;
        default: m64.template operator()<1>();
      }
    }
    gpu::combine_down(g2.g, plan, row_weights, scale, out, stream, dependent || pl.dependent_gemms);
  }

  // Decode: GEMM1 on the stream GEMMs into f32 act, act quantized per row and 128 columns by the
  // input rows' kernel, GEMM2 on the stream GEMMs; each launch the previous one's programmatic
  // dependent (GEMM2 loads its first weights before its wait).
  template <class T>
  void run_stream(kernels::moe_gemm_fp8_params<T>& g1, kernels::moe_gemm_fp8_params<T>& g2, const fp8_weights& q,
                  const gpu::fp8_plan& pl, const gpu::tile_schedule& schedule, char* base,
                  const gpu::device_facts& dev, cudaStream_t stream) {
    using kernels::moe_gemm_kind;
    using policy = gpu::stream_gemm_fp8_policy;
    const std::int64_t slots = pl.num_tokens * cfg_.top_k();
    auto* act_f32 = reinterpret_cast<float*>(base + pl.workspace.act_f32);
    g1.b = q.w13;
    g1.act_f32 = act_f32;
    g2.b = q.w2;
    // As cuda_fused's stream GEMMs by default (gpu::stream_l2_use): 256-byte fetches where a
    // warp walks 16 or more 128-byte K tiles; no evict-first policy (kernels::moe_stream_gemm::l2_policy).
    const gpu::stream_l2_use l2{};
    g1.g.weights_fetch_256 = gpu::stream_fetch_256<policy>(l2, g1.g.k, 1);
    g2.g.weights_fetch_256 = gpu::stream_fetch_256<policy>(l2, g2.g.k, 1);
    if (cfg_.is_gated())
      gpu::launch_moe_stream_gemm<T, policy, moe_gemm_kind::gate_up, true>(g1, schedule, dev, stream, true);
    else gpu::launch_moe_stream_gemm<T, policy, moe_gemm_kind::up_only, true>(g1, schedule, dev, stream, true);
    // Rows past the plan's count hold nothing GEMM2 reads; quantizing them is harmless.
    gpu::quantize_rows_fp8(static_cast<const float*>(act_f32), slots, cfg_.intermediate_size(), g1.act,
                           g1.act_scale, stream, true);
    gpu::launch_moe_stream_gemm<T, policy, moe_gemm_kind::down, true>(g2, schedule, dev, stream, true);
  }

  MoeRunnerConfig cfg_;
  gpu::fp8_settings settings_;
};

static_assert(explain_dispatch_runner_core<cuda_fused_fp8_policy>());
static_assert(!std::is_polymorphic_v<cuda_fused_fp8_policy>);

}  // namespace moerunner

// Checks every runner performs before a policy sees its arguments, so that a
// rejected call writes nothing.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "moerunner/core/config.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/quant/quant_info.hpp"

namespace moerunner::detail {

inline void validate_dispatch(const MoeRunnerConfig& cfg, const DispatchOutput& d, const tensor_view& out,
                              memory_space space, const char* where) {
  const tensor_view& x = d.hidden_states;
  check::rank(x, 2, where, "hidden_states");
  check::space(x, space, where, "hidden_states");
  check::contiguous(x, where, "hidden_states");
  check::non_null(x, where, "hidden_states");
  MOE_EXPECT(is_activation_dtype(x.type) || x.type == dtype::f8_e4m3, where,
             "hidden_states must be f32, f16, bf16 or f8_e4m3, got " + std::string(dtype_name(x.type)));
  check::dim(x, 1, cfg.hidden_size(), where, "hidden_states");
  const std::int64_t m = x.shape[0];
  check::dense(d.topk.topk_weights, 2, dtype::f32, space, where, "topk_weights");
  check::dense(d.topk.topk_ids, 2, dtype::i32, space, where, "topk_ids");
  check::dim(d.topk.topk_weights, 0, m, where, "topk_weights");
  check::dim(d.topk.topk_weights, 1, cfg.top_k(), where, "topk_weights");
  check::dim(d.topk.topk_ids, 0, m, where, "topk_ids");
  check::dim(d.topk.topk_ids, 1, cfg.top_k(), where, "topk_ids");
  if (x.type == dtype::f8_e4m3) {
    const std::int64_t groups = (cfg.hidden_size() + 127) / 128;
    check::dense(d.hidden_scales, 2, dtype::f32, space, where, "hidden_scales");
    check::dim(d.hidden_scales, 0, m, where, "hidden_scales");
    check::dim(d.hidden_scales, 1, groups, where, "hidden_scales");
  }
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(d.status) % alignof(moe_status) == 0, where,
             "status must be " + std::to_string(alignof(moe_status)) + "-byte aligned");
  const dtype out_type = x.type == dtype::f8_e4m3 ? dtype::bf16 : x.type;
  if (cfg.no_combine()) {
    check::dense(out, 3, out.type, space, where, "output");
    check::dim(out, 0, m, where, "output");
    check::dim(out, 1, cfg.top_k(), where, "output");
    check::dim(out, 2, cfg.hidden_size(), where, "output");
  } else {
    check::dense(out, 2, out.type, space, where, "output");
    check::dim(out, 0, m, where, "output");
    check::dim(out, 1, cfg.hidden_size(), where, "output");
  }
  MOE_EXPECT(out.type == out_type, where,
             "output must be " + std::string(dtype_name(out_type)) + " to match hidden_states, got " +
                 std::string(dtype_name(out.type)));
  if (cfg.inplace()) {
    MOE_EXPECT(out.data == x.data, where, "inplace is set but output does not alias hidden_states");
    // An fp8 input is narrower than its bf16 output: writing over it would run past its end.
    MOE_EXPECT(x.type == out.type, where, "inplace needs hidden_states of the output's dtype, got " +
                                              std::string(dtype_name(x.type)));
  } else if (m > 0) {
    const auto* o0 = static_cast<const char*>(out.data);
    const auto* x0 = static_cast<const char*>(x.data);
    MOE_EXPECT(o0 + out.bytes() <= x0 || x0 + x.bytes() <= o0, where,
               "output overlaps hidden_states; set inplace to write over the input");
  }
}

// A contiguous tensor of shape `dims` in `space` with a pointer unless empty.
inline void validate_shape(const tensor_view& t, std::initializer_list<std::int64_t> dims, memory_space space,
                           const char* where, const char* what) {
  check::rank(t, static_cast<int>(dims.size()), where, what);
  check::space(t, space, where, what);
  check::contiguous(t, where, what);
  check::non_null(t, where, what);
  int d = 0;
  for (std::int64_t n : dims) check::dim(t, d++, n, where, what);
}

inline void validate_weight(const tensor_view& w, std::int64_t e, std::int64_t rows, std::int64_t cols,
                            memory_space space, const char* where, const char* what) {
  validate_shape(w, {e, rows, cols}, space, where, what);
}

// An optional per-expert bias [e, cols]: an empty view passes; otherwise f32 or `weight_type`,
// contiguous, aligned to its element, in `space`.
inline void validate_bias(const tensor_view& b, std::int64_t e, std::int64_t cols, dtype weight_type,
                          memory_space space, const char* where, const char* what) {
  if (b.empty_view()) return;
  validate_shape(b, {e, cols}, space, where, what);
  MOE_EXPECT(b.type == dtype::f32 || b.type == weight_type, where,
             std::string(what) + " must be f32 or " + std::string(dtype_name(weight_type)) +
                 " (the weights' dtype), got " + std::string(dtype_name(b.type)));
  check::aligned(b, dtype_size(b.type), where, what);
}

inline void validate_quant_info(const MoeRunnerConfig& cfg, const unquantized_quant_info& q, memory_space space,
                                const char* where) {
  validate_weight(q.w13, cfg.num_local_experts(), cfg.w13_rows(), cfg.hidden_size(), space, where, "w13");
  validate_weight(q.w2, cfg.num_local_experts(), cfg.hidden_size(), cfg.intermediate_size(), space, where, "w2");
  MOE_EXPECT(is_activation_dtype(q.w13.type), where,
             "unquantized w13 must be f32, f16 or bf16, got " + std::string(dtype_name(q.w13.type)));
  MOE_EXPECT(q.w2.type == q.w13.type, where, "w2 and w13 must have the same dtype");
  validate_bias(q.b13, cfg.num_local_experts(), cfg.w13_rows(), q.w13.type, space, where, "b13");
  validate_bias(q.b2, cfg.num_local_experts(), cfg.hidden_size(), q.w13.type, space, where, "b2");
}

// e4m3 weights with f32 scales shaped by the format: [E, blocks of rows, blocks of cols] per
// 128x128 block, [E, rows] per channel, [E] per tensor.
template <fp8_weight_scaling S>
void validate_quant_info(const MoeRunnerConfig& cfg, const fp8_quant_info<S>& q, memory_space space,
                         const char* where) {
  const std::int64_t e = cfg.num_local_experts(), rows = cfg.w13_rows(), h = cfg.hidden_size(),
                     inter = cfg.intermediate_size();
  validate_weight(q.w13, e, rows, h, space, where, "w13");
  validate_weight(q.w2, e, h, inter, space, where, "w2");
  check::type(q.w13, dtype::f8_e4m3, where, "w13");
  check::type(q.w2, dtype::f8_e4m3, where, "w2");
  const auto scales = [&](const tensor_view& s, std::int64_t r, std::int64_t c, const char* what) {
    constexpr int b = fp8_quant_info<S>::group;
    if constexpr (S == fp8_weight_scaling::block128)
      validate_shape(s, {e, (r + b - 1) / b, (c + b - 1) / b}, space, where, what);
    else if constexpr (S == fp8_weight_scaling::per_channel) validate_shape(s, {e, r}, space, where, what);
    else validate_shape(s, {e}, space, where, what);
    check::type(s, dtype::f32, where, what);
  };
  scales(q.w13_scale, rows, h, "w13_scale");
  scales(q.w2_scale, h, inter, "w2_scale");
}

// Host ids only: every id in [-1, num_local_experts), so that a host policy may index its
// weights by id without a check of its own. Device ids cannot be read here without a sync.
inline void validate_host_ids(const MoeRunnerConfig& cfg, const tensor_view& topk_ids, const char* where) {
  const auto* ids = topk_ids.ptr<const std::int32_t>();
  const std::int64_t n = topk_ids.numel();
  for (std::int64_t i = 0; i < n; ++i)
    MOE_EXPECT(ids[i] >= -1 && ids[i] < cfg.num_local_experts(), where,
               "topk_ids[" + std::to_string(i / cfg.top_k()) + ", " + std::to_string(i % cfg.top_k()) + "] = " +
                   std::to_string(ids[i]) + " is outside [-1, num_local_experts=" +
                   std::to_string(cfg.num_local_experts()) + ")");
}

inline void validate_workspace(std::size_t needed, const workspace_view& ws, const char* where) {
  MOE_EXPECT(ws.bytes >= needed, where,
             "workspace too small: " + std::to_string(ws.bytes) + " bytes given, " + std::to_string(needed) +
                 " needed (ask workspace_bytes)");
  MOE_EXPECT(needed == 0 || ws.data != nullptr, where, "workspace has a null data pointer");
}

}  // namespace moerunner::detail

// Backend-neutral quant info: what a runner core needs to read an expert's weights.
// Each struct is one weight format; a policy lists the formats it consumes.
#pragma once

#include <concepts>
#include <cstdint>
#include <string_view>

#include "moerunner/core/tensor_view.hpp"

namespace moerunner {

// The weights a layer owns. Scales are empty views for unquantized formats.
struct moe_weights {
  tensor_view w13;        // [E, 2I, H] (gated, rows as the config's gate_up_layout orders them) or [E, I, H]
  tensor_view w2;         // [E, H, I]
  tensor_view w13_scale;  // fp8 f32 scales: [E, ceil(rows/128), ceil(H/128)], [E, rows] or [E]
  tensor_view w2_scale;   // fp8 f32 scales: [E, ceil(H/128), ceil(I/128)], [E, H] or [E]
  tensor_view b13{};      // optional (gpt-oss): [E, 2I] or [E, I], ordered as w13's rows
  tensor_view b2{};       // optional (gpt-oss): [E, H]
};

// bf16 / fp16 / f32 weights, used as they are, with optional per-expert biases (gpt-oss):
//   h = w13[e] x + b13[e], act(h), y = w2[e] act + b2[e]; out = sum over slots of w * scale * y.
// A bias is f32 or the weights' dtype, contiguous, in the backend's memory space; an empty view
// (the default) means none.
struct unquantized_quant_info {
  static constexpr std::string_view format = "unquantized";
  tensor_view w13;
  tensor_view w2;
  tensor_view b13{};  // [E, 2I] ([E, I] ungated), ordered as w13's rows
  tensor_view b2{};   // [E, H]
};

// How an fp8 format's f32 scales cover each expert's weight matrix [rows, cols].
enum class fp8_weight_scaling : std::uint8_t {
  block128,     // [E, ceil(rows/128), ceil(cols/128)]: one per 128 x 128 block (DeepSeek-V3)
  per_tensor,   // [E]: one per expert matrix
  per_channel,  // [E, rows]: one per output row
};

constexpr std::string_view fp8_format_name(fp8_weight_scaling s) {
  switch (s) {
    case fp8_weight_scaling::per_tensor: return "fp8_e4m3_per_tensor";
    case fp8_weight_scaling::per_channel: return "fp8_e4m3_per_channel";
    case fp8_weight_scaling::block128: break;
  }
  return "fp8_e4m3_block128";
}

// The fp8 e4m3 weight formats, one type per scaling. Each quantizes activations the same way:
// per token in groups of 128 along the reduction dimension (x for GEMM1, act for GEMM2), scale
// amax / 448, so per-tensor and per-channel checkpoints get activation scales as fine as the
// block format's.
template <fp8_weight_scaling Scaling>
struct fp8_quant_info {
  static constexpr fp8_weight_scaling scaling = Scaling;
  static constexpr std::string_view format = fp8_format_name(Scaling);
  static constexpr int group = 128;  // activation quantization group, and the block format's block
  tensor_view w13;
  tensor_view w13_scale;
  tensor_view w2;
  tensor_view w2_scale;
};

using fp8_block_quant_info = fp8_quant_info<fp8_weight_scaling::block128>;     // one f32 scale per 128x128 block
using fp8_tensor_quant_info = fp8_quant_info<fp8_weight_scaling::per_tensor>;  // w13_scale [E], w2_scale [E]
using fp8_channel_quant_info = fp8_quant_info<fp8_weight_scaling::per_channel>;  // [E, rows of w13], [E, H]

template <class Q>
concept fp8_weight_format = requires { Q::scaling; } && std::same_as<Q, fp8_quant_info<Q::scaling>>;

// Index into the scale tensor of weight (r, c) of expert e's [rows, cols] matrix.
constexpr std::int64_t fp8_weight_scale_index(fp8_weight_scaling s, std::int64_t e, std::int64_t r, std::int64_t c,
                                              std::int64_t rows, std::int64_t cols) {
  switch (s) {
    case fp8_weight_scaling::per_tensor: return e;
    case fp8_weight_scaling::per_channel: return e * rows + r;
    case fp8_weight_scaling::block128: break;
  }
  return (e * ((rows + 127) / 128) + r / 128) * ((cols + 127) / 128) + c / 128;
}

template <class... Q>
struct quant_info_list {};

}  // namespace moerunner

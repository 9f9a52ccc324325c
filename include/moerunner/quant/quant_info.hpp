// Backend-neutral quant info: what a runner core needs to read an expert's weights.
// Each struct is one weight format; a policy lists the formats it consumes.
#pragma once

#include <string_view>

#include "moerunner/core/tensor_view.hpp"

namespace moerunner {

// The weights a layer owns. Scales are empty views for unquantized formats.
struct moe_weights {
  tensor_view w13;        // [E, 2I, H] (gated, rows as the config's gate_up_layout orders them) or [E, I, H]
  tensor_view w2;         // [E, H, I]
  tensor_view w13_scale;  // fp8: [E, ceil(rows/128), ceil(H/128)] f32
  tensor_view w2_scale;   // fp8: [E, ceil(H/128), ceil(I/128)] f32
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

// fp8 e4m3 weights with one f32 scale per 128x128 block; activations are quantized
// per token in groups of 128 along the reduction dimension (DeepSeek-V3 style).
struct fp8_block_quant_info {
  static constexpr std::string_view format = "fp8_e4m3_block128";
  static constexpr int block = 128;
  tensor_view w13;
  tensor_view w13_scale;
  tensor_view w2;
  tensor_view w2_scale;
};

template <class... Q>
struct quant_info_list {};

}  // namespace moerunner

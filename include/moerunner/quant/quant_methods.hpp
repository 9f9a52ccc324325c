// Quant methods: how a layer's weights become the quant info a backend consumes.
// get_moe_quant_info(method, weights, backend) is the backend-neutral entry point.
#pragma once

#include <string>
#include <string_view>

#include "moerunner/core/concepts.hpp"
#include "moerunner/quant/quant_info.hpp"

namespace moerunner {

// bf16 / fp16 / f32 weights; feeds any backend that lists unquantized_quant_info.
struct unquantized_method {
  static constexpr std::string_view name = "unquantized";

  template <class P>
    requires concept_parts::runs_with<P, unquantized_quant_info>
  unquantized_quant_info get_moe_quant_info(const moe_weights& w, backend_tag<P>) const {
    return {w.w13, w.w2, w.b13, w.b2};
  }
};

// fp8 e4m3 weights with f32 scales (moe_weights' w13_scale and w2_scale) of one granularity;
// feeds backends that list the matching fp8_quant_info.
template <class QI>
struct fp8_method_base {
  template <class P>
    requires concept_parts::runs_with<P, QI>
  QI get_moe_quant_info(const moe_weights& w, backend_tag<P>) const {
    return {w.w13, w.w13_scale, w.w2, w.w2_scale};
  }
};

struct fp8_block_method : fp8_method_base<fp8_block_quant_info> {  // one scale per 128x128 block
  static constexpr std::string_view name = "fp8_block";
};
struct fp8_tensor_method : fp8_method_base<fp8_tensor_quant_info> {  // one scale per expert matrix
  static constexpr std::string_view name = "fp8_tensor";
};
struct fp8_channel_method : fp8_method_base<fp8_channel_quant_info> {  // one scale per output row
  static constexpr std::string_view name = "fp8_channel";
};

// Static pair: a method that cannot feed the backend fails to compile, with a sentence.
template <class P, class QM>
auto get_moe_quant_info(const QM& method, const moe_weights& weights) {
  static_assert(explain_quant_info_provider<QM, P>());
  return method.get_moe_quant_info(weights, backend_tag<P>{});
}

// The runtime message used where a backend name decides the pair.
inline std::string no_quant_info_message(std::string_view method, std::string_view backend) {
  return "quant method '" + detail::echo(method) + "' does not expose quant info for backend '" +
         detail::echo(backend) + "'";
}

}  // namespace moerunner

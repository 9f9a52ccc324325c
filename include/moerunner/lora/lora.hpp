// LoRA contract. The LoRA math lives in LoRA-capable policies; this header only
// decides whether hooks exist. The rule from the engines: with LoRA off, return
// before anything LoRA-related is validated, built or read.
#pragma once

#include <concepts>
#include <optional>
#include <string>

#include "moerunner/core/backend_id.hpp"
#include "moerunner/core/concepts.hpp"
#include "moerunner/core/error.hpp"

namespace moerunner {

// Adapter weights for one MoE layer (the views are not read unless LoRA is on).
struct lora_weights {
  tensor_view w13_a;  // [E, r, H]
  tensor_view w13_b;  // [E, rows(w13), r]
  tensor_view w2_a;   // [E, r, I]
  tensor_view w2_b;   // [E, H, r]
  float scaling = 1.0f;
};

// What a LoRA-capable core receives next to its quant info.
struct lora_hooks {
  backend_id backend;  // the base layer's resolved backend, never a second lookup
  lora_weights weights;  // views, copied so the hooks never dangle
};

// A policy is LoRA-capable when it says so and has the run overload that takes hooks.
template <class P>
concept LoraCapable = requires {
  { P::supports_lora } -> std::convertible_to<bool>;
} && P::supports_lora && requires(P& p, const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out, workspace_view ws, cuda::stream_ref s, const lora_hooks& h) {
  { p.run_from_dispatch(d, q, out, ws, s, h) } -> std::same_as<CombineInput>;
};

// A policy that sets supports_lora must also have the run overload taking hooks: without
// this check it would silently count as not LoRA-capable, and a LoRA-enabled layer would
// fail at run time far from the cause.
template <class P>
consteval bool explain_lora_capability() {
  if constexpr (requires { P::supports_lora; }) {
    static_assert(!P::supports_lora || LoraCapable<P>,
                  "LoraCapable: the policy sets supports_lora = true but is missing `CombineInput "
                  "run_from_dispatch(const DispatchOutput&, const unquantized_quant_info&, const tensor_view& out, "
                  "workspace_view, cuda::stream_ref, const lora_hooks&)`.");
  }
  return true;
}

namespace detail {
inline void validate_lora_weights(const lora_weights& w, const char* where) {
  for (const tensor_view* t : {&w.w13_a, &w.w13_b, &w.w2_a, &w.w2_b}) {
    check::well_formed(*t, where, "a LoRA adapter weight");
    MOE_EXPECT(t->rank == 3 && t->data != nullptr, where, "LoRA is on but an adapter weight is missing or not [E, ., .]");
  }
  const auto r = w.w13_a.shape[1];
  MOE_EXPECT(r > 0 && w.w13_b.shape[2] == r && w.w2_a.shape[1] == r && w.w2_b.shape[2] == r, where,
             "LoRA adapter ranks disagree: w13_a " + w.w13_a.shape_string() + ", w13_b " + w.w13_b.shape_string() +
                 ", w2_a " + w.w2_a.shape_string() + ", w2_b " + w.w2_b.shape_string());
}
}  // namespace detail

// Builds hooks for the policy a runner resolved. Returns early, touching nothing,
// when LoRA is off; a policy that cannot do LoRA is an error only when LoRA is on.
template <class P>
std::optional<lora_hooks> maybe_build_lora_hooks(bool lora_enabled, const backend_id& base_backend,
                                                 const lora_weights& weights) {
  if (!lora_enabled) return std::nullopt;
  if constexpr (!LoraCapable<P>) {
    throw unsupported_error("LoRA is enabled but backend '" + std::string(base_backend.name()) +
                            "' is not LoRA-capable (its policy does not set supports_lora)");
  } else {
    detail::validate_lora_weights(weights, "maybe_build_lora_hooks");
    return lora_hooks{base_backend, weights};
  }
}

}  // namespace moerunner

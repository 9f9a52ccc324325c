// FusedMoE: one MoE layer as an engine holds it. The quant method is injected
// explicitly; the runner may be absent ("no runner" is a valid, checked state).
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "moerunner/lora/lora.hpp"
#include "moerunner/quant/quant_methods.hpp"
#include "moerunner/runner/moe_runner.hpp"

namespace moerunner {

template <class Runner, class QuantMethod>
class FusedMoE {
 public:
  // Checks, once, that the quant method can feed the runner's backend and builds LoRA
  // hooks from that same backend (or none at all when LoRA is off).
  FusedMoE(QuantMethod method, moe_weights weights, std::optional<Runner> runner, bool lora_enabled = false,
           lora_weights lora = {})
      : method_(std::move(method)),
        weights_(weights),
        runner_(std::move(runner)),
        lora_enabled_(lora_enabled),
        lora_(lora) {
    if (!runner_) {
      MOE_EXPECT(!lora_enabled_, "FusedMoE", "LoRA is enabled but the layer has no runner");
      return;
    }
    if (!runner_->template accepts_method<QuantMethod>())
      throw unsupported_error(no_quant_info_message(QuantMethod::name, runner_->runner_backend().name()));
    hooks_ = runner_->visit([&](auto& core) {
      using P = std::decay_t<decltype(core)>;
      return maybe_build_lora_hooks<P>(lora_enabled_, runner_->runner_backend(), lora_);
    });
  }

  bool has_runner() const { return runner_.has_value(); }
  const QuantMethod& quant_method() const { return method_; }
  bool lora_enabled() const { return lora_enabled_; }
  const std::optional<lora_hooks>& hooks() const { return hooks_; }

  Runner& runner() {
    MOE_EXPECT(runner_.has_value(), "FusedMoE", "the layer was built without a runner");
    return *runner_;
  }

  std::size_t workspace_bytes(std::int64_t num_tokens) { return runner().workspace_bytes(num_tokens); }
  std::size_t max_workspace_bytes(std::int64_t max_tokens) { return runner().max_workspace_bytes(max_tokens); }

  CombineInput forward(const DispatchOutput& d, const tensor_view& out, workspace_view ws, cuda::stream_ref stream) {
    Runner& r = runner();
    return r.visit([&](auto& core) -> CombineInput {
      using P = std::decay_t<decltype(core)>;
      if constexpr (!QuantInfoProvider<QuantMethod, P>) {
        throw unsupported_error(no_quant_info_message(QuantMethod::name, r.runner_backend().name()));
      } else {
        const auto info = method_.get_moe_quant_info(weights_, backend_tag<P>{});
        return r.run(d, info, out, ws, stream, hooks_ ? &*hooks_ : nullptr);
      }
    });
  }

 private:
  QuantMethod method_;
  moe_weights weights_;
  std::optional<Runner> runner_;
  bool lora_enabled_;
  lora_weights lora_;
  std::optional<lora_hooks> hooks_;
};

}  // namespace moerunner

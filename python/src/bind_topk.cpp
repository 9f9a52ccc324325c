// moerunner._moerunner.topk: reference::topk for host logits, gpu::topk for device logits,
// with the keyword arguments of topk_config.
#include <cstdint>
#include <optional>
#include <string_view>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string_view.h>

#include "bindings.hpp"
#include "runner_set.hpp"
#include "tensor_args.hpp"

namespace moerunner::python {

namespace {

void topk(const nb::ndarray<>& logits, const nb::ndarray<>& topk_weights, const nb::ndarray<>& topk_ids,
          const std::optional<nb::ndarray<>>& correction_bias, std::uintptr_t stream, int top_k,
          std::string_view scoring, bool renormalize, int num_expert_group, int topk_group,
          float routed_scaling_factor, bool apply_routed_scaling_factor_on_weights, int num_fused_shared_experts,
          float fused_shared_expert_weight) {
  constexpr scoring_func funcs[] = {scoring_func::softmax, scoring_func::sigmoid};
  const bool host_logits = logits.device_type() == nb::device::cpu::value ||
                           logits.device_type() == nb::device::cuda_host::value;
  const char* where = host_logits ? "reference::topk" : "gpu::topk";
  topk_config cfg;
  cfg.top_k = top_k;
  cfg.scoring = parse_enum(scoring, funcs, scoring_name, where, "scoring");
  cfg.renormalize = renormalize;
  cfg.num_expert_group = num_expert_group;
  cfg.topk_group = topk_group;
  cfg.routed_scaling_factor = routed_scaling_factor;
  cfg.apply_routed_scaling_factor_on_weights = apply_routed_scaling_factor_on_weights;
  cfg.num_fused_shared_experts = num_fused_shared_experts;
  cfg.fused_shared_expert_weight = fused_shared_expert_weight;

  tensor_args views(where);
  const tensor_view logits_view = views(logits, "router_logits");
  const tensor_view bias = views(correction_bias, "correction_bias");
  TopKOutput out{views(topk_weights, "topk_weights"), views(topk_ids, "topk_ids")};
  const tensor_view* bias_ptr = correction_bias ? &bias : nullptr;
  if (host_logits) {
    nb::gil_scoped_release unlocked;
    reference::topk(logits_view, bias_ptr, cfg, out);
  } else {
    device_topk(logits_view, bias_ptr, cfg, out, stream, views.device());
  }
}

}  // namespace

void bind_topk(nb::module_& m) {
  const topk_config defaults{};
  m.def("topk", &topk, nb::arg("router_logits"), nb::arg("topk_weights"), nb::arg("topk_ids"),
        nb::arg("correction_bias").none(), nb::arg("stream"), nb::kw_only(), nb::arg("top_k"),
        nb::arg("scoring") = scoring_name(defaults.scoring), nb::arg("renormalize") = defaults.renormalize,
        nb::arg("num_expert_group") = defaults.num_expert_group, nb::arg("topk_group") = defaults.topk_group,
        nb::arg("routed_scaling_factor") = defaults.routed_scaling_factor,
        nb::arg("apply_routed_scaling_factor_on_weights") = defaults.apply_routed_scaling_factor_on_weights,
        nb::arg("num_fused_shared_experts") = defaults.num_fused_shared_experts,
        nb::arg("fused_shared_expert_weight") = defaults.fused_shared_expert_weight);
}

}  // namespace moerunner::python

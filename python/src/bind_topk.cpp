// moerunner._moerunner.topk: reference::topk for host logits, gpu::topk for device logits,
// with the keyword arguments of topk_config.
#include <cstdint>
#include <string_view>

#include <nanobind/stl/string_view.h>

#include "bindings.hpp"
#include "runner_set.hpp"
#include "tensor_args.hpp"

namespace moerunner::python {

namespace {

// Arrays and stream as MoeRunner::run takes them (bind_runner.cpp).
void topk(nb::handle logits, nb::handle topk_weights, nb::handle topk_ids, nb::handle correction_bias,
          nb::handle stream, int top_k,
          std::string_view scoring, bool renormalize, int num_expert_group, int topk_group,
          float routed_scaling_factor, bool apply_routed_scaling_factor_on_weights, int num_fused_shared_experts,
          float fused_shared_expert_weight) {
  constexpr scoring_func funcs[] = {scoring_func::softmax, scoring_func::sigmoid};
  // The logits' memory picks the implementation, whose name the messages carry.
  tensor_args views("topk");
  const dl_array logits_array = views.import(logits, "router_logits");
  const bool host_logits = logits_array.on_host();
  const char* where = host_logits ? "reference::topk" : "gpu::topk";
  views.set_where(where);
  const tensor_view logits_view = views.view(logits_array, "router_logits");
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

  const tensor_view bias = views.optional(correction_bias, "correction_bias");
  TopKOutput out{views.written(topk_weights, "topk_weights"), views.written(topk_ids, "topk_ids")};
  const tensor_view* bias_ptr = correction_bias.is_none() ? nullptr : &bias;
  // Read (and a bad value refused, as run refuses it) on the host too, where nothing uses it.
  const std::uintptr_t on_stream = views.stream(stream, logits);
  if (host_logits) {
    nb::gil_scoped_release unlocked;
    reference::topk(logits_view, bias_ptr, cfg, out);
  } else {
    device_topk(logits_view, bias_ptr, cfg, out, on_stream, views.device());
  }
}

}  // namespace

void bind_topk(nb::module_& m) {
  const topk_config defaults{};
  m.def("topk", &topk, nb::arg("router_logits").none(), nb::arg("topk_weights").none(), nb::arg("topk_ids").none(),
        nb::arg("correction_bias").none(), nb::arg("stream").none(), nb::kw_only(), nb::arg("top_k"),
        nb::arg("scoring") = scoring_name(defaults.scoring), nb::arg("renormalize") = defaults.renormalize,
        nb::arg("num_expert_group") = defaults.num_expert_group, nb::arg("topk_group") = defaults.topk_group,
        nb::arg("routed_scaling_factor") = defaults.routed_scaling_factor,
        nb::arg("apply_routed_scaling_factor_on_weights") = defaults.apply_routed_scaling_factor_on_weights,
        nb::arg("num_fused_shared_experts") = defaults.num_fused_shared_experts,
        nb::arg("fused_shared_expert_weight") = defaults.fused_shared_expert_weight);
}

}  // namespace moerunner::python

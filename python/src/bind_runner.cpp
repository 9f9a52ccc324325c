// moerunner._moerunner.Runner: a MoeRunner of this build's runner set, built from keyword
// arguments that mirror moe_config_params and validated by MoeRunnerConfig.
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include "bindings.hpp"
#include "runner_set.hpp"
#include "tensor_args.hpp"

namespace moerunner::python {

namespace {

moe_config_params make_params(int num_experts, int hidden_size, int intermediate_size, int top_k,
                              int num_local_experts, std::string_view act, float alpha, float limit, bool is_gated,
                              std::string_view layout, bool apply_router_weight_on_input,
                              float routed_scaling_factor, bool no_combine, bool inplace, bool deterministic,
                              bool batch_invariant) {
  constexpr const char* where = "MoeRunnerConfig";
  constexpr activation_kind kinds[] = {activation_kind::silu, activation_kind::gelu, activation_kind::swiglu_clamped};
  constexpr w13_layout layouts[] = {w13_layout::halves, w13_layout::interleaved};
  moe_config_params p;
  p.num_experts = num_experts;
  p.num_local_experts = num_local_experts;
  p.hidden_size = hidden_size;
  p.intermediate_size = intermediate_size;
  p.top_k = top_k;
  p.act = {parse_enum(act, kinds, activation_name, where, "activation"), alpha, limit};
  p.is_gated = is_gated;
  p.gate_up_layout = parse_enum(layout, layouts, w13_layout_name, where, "gate_up_layout");
  p.apply_router_weight_on_input = apply_router_weight_on_input;
  p.routed_scaling_factor = routed_scaling_factor;
  p.no_combine = no_combine;
  p.inplace = inplace;
  p.deterministic = deterministic;
  p.batch_invariant = batch_invariant;
  return p;
}

// A run's arguments as the caller passed them (see MoeRunner.run).
struct run_args {
  nb::handle x, topk_ids, topk_weights, w13, w2, out, workspace, stream, b13, b2, status, hidden_scales, w13_scale,
      w2_scale;
};

class runner {
 public:
  runner(std::string_view backend, const moe_config_params& p) : impl_(make_runner(backend, MoeRunnerConfig(p))) {}

  // The config as validated (num_local_experts filled in, deterministic implied by batch_invariant).
  nb::dict config() const {
    const MoeRunnerConfig& c = impl_->config();
    nb::dict d;
    d["num_experts"] = c.num_experts();
    d["num_local_experts"] = c.num_local_experts();
    d["hidden_size"] = c.hidden_size();
    d["intermediate_size"] = c.intermediate_size();
    d["top_k"] = c.top_k();
    d["activation"] = std::string(activation_name(c.act().kind));
    d["activation_alpha"] = c.act().alpha;
    d["activation_limit"] = c.act().limit;
    d["is_gated"] = c.is_gated();
    d["gate_up_layout"] = std::string(w13_layout_name(c.gate_up_layout()));
    d["apply_router_weight_on_input"] = c.apply_router_weight_on_input();
    d["routed_scaling_factor"] = c.routed_scaling_factor();
    d["no_combine"] = c.no_combine();
    d["inplace"] = c.inplace();
    d["deterministic"] = c.deterministic();
    d["batch_invariant"] = c.batch_invariant();
    return d;
  }

  std::string backend() const { return std::string(impl_->backend()); }
  std::string tensor_space() const { return std::string(memory_space_name(impl_->tensor_space())); }
  std::size_t workspace_bytes(std::int64_t m, int device) const { return impl_->workspace_bytes(m, device); }
  std::size_t max_workspace_bytes(std::int64_t m, int device) const { return impl_->max_workspace_bytes(m, device); }
  std::string describe(std::int64_t m, int device) const { return impl_->describe(m, device); }

  // Arrays come as Python objects, converted by tensor_args (None: not given, where optional);
  // stream as an int, None or a stream object (see tensor_args::stream).
  void run(const run_args& a) {
    with_views(a, [this](const DispatchOutput& d, const auto& q, const tensor_view& out, workspace_view ws,
                         std::uintptr_t stream, int device) { call(d, q, out, ws, stream, device); });
  }

  // Seconds that `iters` runs of the library take on arguments converted once: the run without
  // the binding, so that a bench can tell the binding's host cost from the library's.
  double time_library(int iters, const run_args& a) {
    MOE_EXPECT(iters > 0, "Runner.time_library", "iters must be positive, got " + std::to_string(iters));
    double seconds = 0;
    with_views(a, [&](const DispatchOutput& d, const auto& q, const tensor_view& out, workspace_view ws,
                      std::uintptr_t stream, int device) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) call(d, q, out, ws, stream, device);
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
    return seconds;
  }

 private:
  // Converts a run's arguments and calls f(dispatch, quant info, out, workspace, stream, device)
  // with the quant info their scales name.
  template <class F>
  void with_views(const run_args& a, F&& f) {
    constexpr const char* where = "MoeRunner::run";
    const memory_space space = impl_->tensor_space();
    tensor_args views(where);
    DispatchOutput d;
    d.hidden_states = views(a.x, "hidden_states");
    d.hidden_scales = views.optional(a.hidden_scales, "hidden_scales");
    d.topk.topk_ids = views(a.topk_ids, "topk_ids");
    d.topk.topk_weights = views(a.topk_weights, "topk_weights");
    const tensor_view out_view = views.written(a.out, "output");
    const workspace_view ws = views.bytes(a.workspace, space, "workspace");  // bytes: any dtype, uint8 as a rule
    if (!a.status.is_none()) {
      const tensor_view s = views.written(a.status, "status");
      check::type(s, dtype::i32, where, "status");
      check::space(s, space, where, "status");
      check::contiguous(s, where, "status");
      MOE_EXPECT(s.numel() == 2, where, "status must hold 2 i32 values (bad_slots, first_bad_slot), got shape " +
                                            s.shape_string());
      d.status = s.ptr<moe_status>();
    }
    const bool fp8 = !a.w13_scale.is_none() || !a.w2_scale.is_none();
    // Converted in argument order, so that a call with several bad arguments names the first.
    const tensor_view w13_view = views(a.w13, "w13");
    const tensor_view w2_view = views(a.w2, "w2");
    const tensor_view b13_view = views.optional(a.b13, "b13");
    const tensor_view b2_view = views.optional(a.b2, "b2");
    const tensor_view s13 = views.optional(a.w13_scale, "w13_scale");
    const tensor_view s2 = views.optional(a.w2_scale, "w2_scale");
    const std::uintptr_t on_stream = views.stream(a.stream, a.x);
    if (fp8) {
      MOE_EXPECT(b13_view.empty_view() && b2_view.empty_view(), where,
                 "b13 and b2 go with unquantized weights; fp8 weights take no biases");
      // The scales' rank names the format: [E, row blocks, column blocks], [E, rows] or [E].
      const auto fp8_call = [&]<class Q>(std::type_identity<Q>) {
        f(d, Q{w13_view, s13, w2_view, s2}, out_view, ws, on_stream, views.device());
      };
      switch (s13.rank) {
        case 3: fp8_call(std::type_identity<fp8_block_quant_info>{}); break;
        case 2: fp8_call(std::type_identity<fp8_channel_quant_info>{}); break;
        case 1: fp8_call(std::type_identity<fp8_tensor_quant_info>{}); break;
        default:
          detail::throw_invalid(where, "w13_scale must have rank 3 (128x128 blocks), 2 (per channel) or 1 (per "
                                       "tensor), got shape " + s13.shape_string());
      }
    } else {
      f(d, unquantized_quant_info{w13_view, w2_view, b13_view, b2_view}, out_view, ws, on_stream, views.device());
    }
  }

  // Runs that wait on the host (the reference computing in the call, cublas_grouped waiting for
  // its routing) release the GIL, and then hold the runner's mutex instead: another Python
  // thread may call the same runner meanwhile, and a policy's scratch state is its own. Runs that
  // only enqueue work keep the GIL (releasing it would cost more than it frees), which also
  // keeps them one at a time.
  template <class QI>
  void call(const DispatchOutput& d, const QI& q, const tensor_view& out, workspace_view ws, std::uintptr_t stream,
            int device) {
    if (waits_on_host_) {
      nb::gil_scoped_release unlocked;
      const std::lock_guard<std::mutex> one_at_a_time(run_mutex_);
      impl_->run(d, q, out, ws, stream, device);
    } else {
      impl_->run(d, q, out, ws, stream, device);
    }
  }

  std::unique_ptr<any_runner> impl_;
  bool waits_on_host_ = impl_->waits_on_host();
  std::mutex run_mutex_;
};

}  // namespace

void bind_runner(nb::module_& m) {
  const moe_config_params defaults{};
  nb::class_<runner>(m, "Runner")
      .def(
          "__init__",
          [](runner* self, std::string_view backend, int num_experts, int hidden_size, int intermediate_size,
             int top_k, int num_local_experts, std::string_view act, float alpha, float limit, bool is_gated,
             std::string_view layout, bool on_input, float scaling, bool no_combine, bool inplace,
             bool deterministic, bool batch_invariant) {
            new (self) runner(backend, make_params(num_experts, hidden_size, intermediate_size, top_k,
                                                   num_local_experts, act, alpha, limit, is_gated, layout, on_input,
                                                   scaling, no_combine, inplace, deterministic, batch_invariant));
          },
          nb::arg("backend"), nb::kw_only(), nb::arg("num_experts"), nb::arg("hidden_size"),
          nb::arg("intermediate_size"), nb::arg("top_k"), nb::arg("num_local_experts") = defaults.num_local_experts,
          nb::arg("activation") = activation_name(defaults.act.kind),
          nb::arg("activation_alpha") = defaults.act.alpha, nb::arg("activation_limit") = defaults.act.limit,
          nb::arg("is_gated") = defaults.is_gated,
          nb::arg("gate_up_layout") = w13_layout_name(defaults.gate_up_layout),
          nb::arg("apply_router_weight_on_input") = defaults.apply_router_weight_on_input,
          nb::arg("routed_scaling_factor") = defaults.routed_scaling_factor,
          nb::arg("no_combine") = defaults.no_combine, nb::arg("inplace") = defaults.inplace,
          nb::arg("deterministic") = defaults.deterministic, nb::arg("batch_invariant") = defaults.batch_invariant)
      .def_prop_ro("backend", &runner::backend)
      .def_prop_ro("tensor_space", &runner::tensor_space)
      .def_prop_ro("config", &runner::config)
      // device: a CUDA device ordinal to plan for (the current device when -1).
      .def("workspace_bytes", &runner::workspace_bytes, nb::arg("num_tokens"), nb::arg("device") = -1)
      .def("max_workspace_bytes", &runner::max_workspace_bytes, nb::arg("max_tokens"), nb::arg("device") = -1)
      .def("describe", &runner::describe, nb::arg("num_tokens"), nb::arg("device") = -1)
      // Every argument may be None (nanobind refuses None for a handle unless told): the run
      // names what is missing, as it names what is wrong.
      .def(
          "run",
          [](runner& r, nb::handle x, nb::handle topk_ids, nb::handle topk_weights, nb::handle w13, nb::handle w2,
             nb::handle out, nb::handle workspace, nb::handle stream, nb::handle b13, nb::handle b2, nb::handle status,
             nb::handle hidden_scales, nb::handle w13_scale, nb::handle w2_scale) {
            r.run({x, topk_ids, topk_weights, w13, w2, out, workspace, stream, b13, b2, status, hidden_scales,
                   w13_scale, w2_scale});
          },
          nb::arg("x").none(), nb::arg("topk_ids").none(), nb::arg("topk_weights").none(), nb::arg("w13").none(),
          nb::arg("w2").none(), nb::arg("out").none(), nb::arg("workspace").none(), nb::arg("stream").none(),
          nb::arg("b13").none(), nb::arg("b2").none(), nb::arg("status").none(), nb::arg("hidden_scales").none(),
          nb::arg("w13_scale").none(), nb::arg("w2_scale").none())
      .def(
          "time_library",
          [](runner& r, int iters, nb::handle x, nb::handle topk_ids, nb::handle topk_weights, nb::handle w13,
             nb::handle w2, nb::handle out, nb::handle workspace, nb::handle stream) {
            return r.time_library(iters, {x, topk_ids, topk_weights, w13, w2, out, workspace, stream, nb::none(),
                                          nb::none(), nb::none(), nb::none(), nb::none(), nb::none()});
          },
          nb::arg("iters"), nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w13"),
          nb::arg("w2"), nb::arg("out"), nb::arg("workspace").none(), nb::arg("stream").none());
}

}  // namespace moerunner::python

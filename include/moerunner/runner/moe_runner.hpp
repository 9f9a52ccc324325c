// MoeRunner<Policies...>: the compile-time list of backends an engine builds in,
// with one picked at run time by name.
//
// The list is a Boost.Hana type list; construction resolves the name once through
// the registry and stores an index; run() reaches the chosen policy through a
// generated chain of index comparisons, so policy code is inlined into the runner:
// no virtual calls and no function pointers on the run path.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

#include <boost/hana/length.hpp>
#include <boost/hana/set.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/type.hpp>
#include <cuda/stream_ref>

#include "moerunner/core/concepts.hpp"
#include "moerunner/core/workspace_max.hpp"
#include "moerunner/lora/lora.hpp"
#include "moerunner/registry/backend_registry.hpp"
#include "moerunner/runner/validate.hpp"

namespace moerunner {

template <class... Policies>
class MoeRunner {
  static_assert(sizeof...(Policies) > 0, "MoeRunner needs at least one backend policy.");
  static_assert((explain_dispatch_runner_core<Policies>() && ...));
  static_assert((explain_lora_capability<Policies>() && ...));
  static constexpr auto policy_list = boost::hana::tuple_t<Policies...>;
  static_assert(boost::hana::length(boost::hana::to_set(policy_list)) == boost::hana::size_c<sizeof...(Policies)>,
                "MoeRunner: a policy type is listed twice.");

 public:
  static constexpr std::size_t num_policies = sizeof...(Policies);

  // Resolves `backend` (built-in or registered) and builds that policy's core.
  MoeRunner(std::string_view backend, const MoeRunnerConfig& config,
            backend_registry& registry = backend_registry::global())
      : config_(config), id_(resolve_and_freeze(registry, backend)), index_(pick_index(registry)) {
    emplace_core(std::make_index_sequence<num_policies>{});
  }

  const backend_id& runner_backend() const { return id_; }
  const MoeRunnerConfig& config() const { return config_; }
  std::size_t policy_index() const { return index_; }

  // Scratch memory one run over `num_tokens` tokens needs; the caller owns it.
  std::size_t workspace_bytes(std::int64_t num_tokens) const {
    return visit([&](const auto& core) { return core.workspace_bytes(num_tokens); });
  }

  // Scratch memory that serves every run of at most max_tokens tokens: what a caller that sizes
  // one buffer for its largest batch asks (a run's need is not monotone in the token count; see
  // core/workspace_max.hpp). The policy's max_workspace_bytes where it has one, else the largest
  // workspace_bytes(m) over m = 0..max_tokens. A setup-time query: one plan per token count.
  std::size_t max_workspace_bytes(std::int64_t max_tokens) const {
    return visit([&](const auto& core) -> std::size_t {
      if constexpr (requires { { core.max_workspace_bytes(max_tokens) } -> std::same_as<std::size_t>; })
        return core.max_workspace_bytes(max_tokens);
      else
        return detail::max_workspace_over_tokens(
            max_tokens, [&](std::int64_t m) { return core.workspace_bytes(m); }, "MoeRunner::max_workspace_bytes");
    });
  }

  // One line for a log saying what a run over num_tokens tokens does: the policy's
  // describe(num_tokens) where it has one (cuda_fused: kernels, tiles, workspace), else its name.
  std::string describe(std::int64_t num_tokens) const {
    return visit([&](const auto& core) -> std::string {
      if constexpr (requires { { core.describe(num_tokens) } -> std::convertible_to<std::string>; })
        return core.describe(num_tokens);
      else
        return std::string(std::decay_t<decltype(core)>::name) + " M=" + std::to_string(num_tokens);
    });
  }

  // Where this runner's tensors must live.
  memory_space tensor_space() const {
    return visit([](const auto& core) { return std::decay_t<decltype(core)>::tensor_space; });
  }

  // True when the chosen backend consumes quant info of type QI.
  template <class QI>
  bool accepts() const {
    return visit([](const auto& core) { return concept_parts::runs_with<std::decay_t<decltype(core)>, QI>; });
  }

  // True when the chosen backend can be fed by quant method QM.
  template <class QM>
  bool accepts_method() const {
    return visit([](const auto& core) { return QuantInfoProvider<QM, std::decay_t<decltype(core)>>; });
  }

  bool lora_capable() const {
    return visit([](const auto& core) { return LoraCapable<std::decay_t<decltype(core)>>; });
  }

  // Runs the chosen core on a dispatch output. `out` is [M, H] ([M, k, H] with no_combine).
  template <class QI>
  CombineInput run(const DispatchOutput& d, const QI& quant_info, const tensor_view& out, workspace_view ws,
                   cuda::stream_ref stream, const lora_hooks* lora = nullptr) {
    return visit([&](auto& core) -> CombineInput {
      using P = std::decay_t<decltype(core)>;
      if constexpr (!concept_parts::runs_with<P, QI>) {
        throw unsupported_error("backend '" + std::string(id_.name()) + "' does not consume quant info '" +
                                detail::echo(QI::format) + "'");
      } else {
        constexpr const char* where = "MoeRunner::run";
        detail::validate_dispatch(config_, d, out, P::tensor_space, where);
        detail::validate_quant_info(config_, quant_info, P::tensor_space, where);
        detail::validate_workspace(core.workspace_bytes(d.num_tokens()), ws, where);
        if constexpr (P::tensor_space == memory_space::host) detail::validate_host_ids(config_, d.topk.topk_ids, where);
        if (lora != nullptr) {
          if constexpr (LoraCapable<P>) {
            return core.run_from_dispatch(d, quant_info, out, ws, stream, *lora);
          } else {
            throw unsupported_error("LoRA hooks were passed but backend '" + std::string(id_.name()) +
                                    "' is not LoRA-capable");
          }
        } else {
          return core.run_from_dispatch(d, quant_info, out, ws, stream);
        }
      }
    });
  }

  // Calls f(core) with the chosen policy object: the generated switch.
  template <class F>
  decltype(auto) visit(F&& f) {
    return visit_impl(*this, std::forward<F>(f), std::make_index_sequence<num_policies>{});
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return visit_impl(*this, std::forward<F>(f), std::make_index_sequence<num_policies>{});
  }

 private:
  template <class Self, class F, std::size_t I0, std::size_t... I>
  static decltype(auto) visit_impl(Self& self, F&& f, std::index_sequence<I0, I...>) {
    using R = decltype(f(*std::get_if<I0 + 1>(&self.core_)));
    if constexpr (sizeof...(I) == 0) {
      return f(*std::get_if<I0 + 1>(&self.core_));
    } else {
      if (self.index_ == I0) return static_cast<R>(f(*std::get_if<I0 + 1>(&self.core_)));
      return static_cast<R>(visit_impl(self, std::forward<F>(f), std::index_sequence<I...>{}));
    }
  }

  template <std::size_t... I>
  void emplace_core(std::index_sequence<I...>) {
    ((index_ == I ? (core_.template emplace<I + 1>(config_), void()) : void()), ...);
  }

  // Freezes a built-in before its policy is picked, so that a replacement registered
  // concurrently is either seen by pick_index or refused, never silently mixed.
  static backend_id resolve_and_freeze(backend_registry& registry, std::string_view backend) {
    const backend_id id = registry.resolve(backend);
    registry.note_resolved(id);
    return id;
  }

  // Which list entry implements id_: a registered policy by its type, else the
  // built-in policy of that name (and not some registered replacement of it).
  std::size_t pick_index(const backend_registry& registry) const {
    const auto record = registry.lookup(id_);
    const void* keys[] = {&policy_type_key<Policies>...};
    const std::string_view names[] = {std::string_view(Policies::name)...};
    std::size_t found = num_policies;
    for (std::size_t i = 0; i < num_policies; ++i) {
      if (names[i] != id_.name()) continue;
      if (record ? keys[i] == record->type_key : !registry.has_policy_type(keys[i])) {
        found = i;
        break;
      }
    }
    if (found != num_policies) return found;
    std::string listed;
    for (auto n : names) listed += (listed.empty() ? "" : ", ") + std::string(n);
    if (record) {
      throw registry_error("backend '" + std::string(id_.name()) + "' is registered at " + record->site.str() +
                           " but that policy is not in this runner's policy list (" + listed +
                           "); add it to MoeRunner<...>");
    }
    throw registry_error("backend '" + std::string(id_.name()) +
                         "' is built in but its policy is not in this runner's policy list (" + listed +
                         "); add it to MoeRunner<...>");
  }

  MoeRunnerConfig config_;
  backend_id id_;
  std::size_t index_;
  std::variant<std::monostate, Policies...> core_;
};

}  // namespace moerunner

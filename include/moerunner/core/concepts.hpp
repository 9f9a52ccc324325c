// The two contracts of the library:
//  - DispatchRunnerCore<P>: a backend policy that consumes a DispatchOutput directly.
//  - QuantInfoProvider<Q, P>: a quant method that can feed policy P its weights.
// Each concept is a conjunction of small named parts so that explain_* can report,
// in a sentence, exactly which member a policy or method is missing.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include <cuda/stream_ref>

#include "moerunner/core/backend_id.hpp"
#include "moerunner/core/config.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/quant/quant_info.hpp"

namespace moerunner {

template <class P>
struct backend_tag {
  using type = P;
};

namespace concept_parts {

template <class P>
concept has_name = requires {
  { P::name } -> std::convertible_to<std::string_view>;
  typename std::integral_constant<std::size_t, std::string_view(P::name).size()>;  // a constant expression
};

template <class P>
concept has_tensor_space = requires {
  { P::tensor_space } -> std::convertible_to<memory_space>;
};

template <class P>
concept config_constructible = std::constructible_from<P, const MoeRunnerConfig&>;

template <class P>
concept has_workspace_query = requires(const P& p, std::int64_t num_tokens) {
  { p.workspace_bytes(num_tokens) } -> std::same_as<std::size_t>;
};

template <class T>
inline constexpr bool is_quant_info_list = false;
template <class... Q>
inline constexpr bool is_quant_info_list<quant_info_list<Q...>> = sizeof...(Q) > 0;

template <class P>
concept has_quant_infos = requires { typename P::quant_infos; } && is_quant_info_list<typename P::quant_infos>;

template <class P, class QI>
concept runs_with = requires(P& p, const DispatchOutput& d, const QI& q, const tensor_view& out, workspace_view ws,
                             cuda::stream_ref s) {
  { p.run_from_dispatch(d, q, out, ws, s) } -> std::same_as<CombineInput>;
};

template <class P, class List>
inline constexpr bool runs_with_all = false;
template <class P, class... Q>
inline constexpr bool runs_with_all<P, quant_info_list<Q...>> = (runs_with<P, Q> && ...);

template <class P>
concept has_run_from_dispatch = has_quant_infos<P> && runs_with_all<P, typename P::quant_infos>;

}  // namespace concept_parts

// What run_from_dispatch receives from MoeRunner::run: every tensor checked for shape, dtype,
// layout and memory space (host tensors also aligned to their element type), and expert ids:
//  - tensor_space == host: every id of topk_ids checked on the host, in [-1, num_local_experts);
//    -1 is a filtered slot that contributes nothing.
//  - tensor_space == device: ids NOT checked (reading them would need a sync). The policy must
//    treat an id outside [-1, num_local_experts) as -1 and never use it as an index, as every
//    built-in does (cuda_fused also raises the routing plan's error flag; cublas_grouped,
//    which waits for its routing anyway, rejects it with invalid_argument_error).
template <class P>
concept DispatchRunnerCore =
    concept_parts::has_name<P> && concept_parts::has_tensor_space<P> && concept_parts::config_constructible<P> &&
    concept_parts::has_workspace_query<P> && concept_parts::has_quant_infos<P> &&
    concept_parts::has_run_from_dispatch<P> && std::is_nothrow_move_constructible_v<P>;

// Reports each missing part of DispatchRunnerCore as a sentence; use next to a policy.
template <class P>
consteval bool explain_dispatch_runner_core() {
  using namespace concept_parts;
  static_assert(has_name<P>,
                "DispatchRunnerCore: the policy is missing `static constexpr std::string_view name`, the backend "
                "name it is selected by.");
  static_assert(has_tensor_space<P>,
                "DispatchRunnerCore: the policy is missing `static constexpr memory_space tensor_space`, where its "
                "tensors must live (host or device).");
  static_assert(config_constructible<P>,
                "DispatchRunnerCore: the policy is missing a constructor taking `const MoeRunnerConfig&`.");
  static_assert(has_workspace_query<P>,
                "DispatchRunnerCore: the policy is missing `std::size_t workspace_bytes(std::int64_t num_tokens) "
                "const`, the scratch memory one run needs.");
  static_assert(has_quant_infos<P>,
                "DispatchRunnerCore: the policy is missing `using quant_infos = quant_info_list<...>`, the weight "
                "formats it consumes (at least one).");
  static_assert(has_run_from_dispatch<P>,
                "DispatchRunnerCore: the policy is missing `CombineInput run_from_dispatch(const DispatchOutput&, "
                "const QuantInfo&, const tensor_view& out, workspace_view, cuda::stream_ref)` for every format in "
                "quant_infos.");
  static_assert(std::is_nothrow_move_constructible_v<P>,
                "DispatchRunnerCore: the policy must be nothrow move constructible.");
  return DispatchRunnerCore<P>;
}

// The name a policy is selected by, as a backend_id.
template <DispatchRunnerCore P>
constexpr backend_id runner_backend_of() {
  return backend_id(std::string_view(P::name));
}

// QuantInfoProvider<Q, P>: method Q turns a layer's weights into a quant info that P consumes.
template <class Q, class P>
concept QuantInfoProvider = requires(const Q& q, const moe_weights& w) {
  { Q::name } -> std::convertible_to<std::string_view>;
  q.get_moe_quant_info(w, backend_tag<P>{});
} && concept_parts::runs_with<P, decltype(std::declval<const Q&>().get_moe_quant_info(std::declval<const moe_weights&>(), backend_tag<P>{}))>;

template <class Q, class P>
consteval bool explain_quant_info_provider() {
  static_assert(requires { Q::name; }, "QuantInfoProvider: the quant method is missing `static constexpr std::string_view name`.");
  static_assert(requires(const Q& q, const moe_weights& w) { q.get_moe_quant_info(w, backend_tag<P>{}); },
                "QuantInfoProvider: the quant method does not expose quant info for this backend: it has no "
                "`get_moe_quant_info(const moe_weights&, backend_tag<Backend>)` overload that accepts it.");
  static_assert(QuantInfoProvider<Q, P>,
                "QuantInfoProvider: the quant method's get_moe_quant_info returns a format this backend does not "
                "list in its quant_infos.");
  return true;
}

}  // namespace moerunner

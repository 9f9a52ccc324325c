// The runner set of a build without CUDA: the reference backend on the host.
#include <string>

#include "runner_set.hpp"

namespace moerunner::python {

namespace {
struct no_device_guard {
  explicit no_device_guard(int) {}
};
}  // namespace

std::unique_ptr<any_runner> make_runner(std::string_view backend, const MoeRunnerConfig& cfg) {
  // A GPU built-in would otherwise meet MoeRunner's "add it to MoeRunner<...>", which speaks to
  // C++ engines; here the remedy is a build with CUDA.
  const backend_id id = backend_registry::global().resolve(backend);
  if (id.is_builtin() && !id.is_reference())
    throw unsupported_error("backend '" + std::string(id.name()) +
                            "' needs the GPU build of the moerunner package: this one was built without CUDA "
                            "(reference only); reinstall it where nvcc is found");
  return std::make_unique<runner_model<MoeRunner<reference_policy>, no_device_guard>>(backend, cfg);
}

std::vector<std::string> runner_backends() { return {std::string(reference_policy::name)}; }

void device_topk(const tensor_view&, const tensor_view*, const topk_config&, TopKOutput&, std::uintptr_t, int) {
  throw unsupported_error("topk: router_logits live in device memory but this moerunner package was built "
                          "without CUDA (gpu::topk needs the GPU build)");
}

}  // namespace moerunner::python

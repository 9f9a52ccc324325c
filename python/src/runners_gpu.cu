// The runner set of a build with CUDA: every built-in backend and gpu::topk, compiled by nvcc.
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/routing.cuh"
#include "moerunner/policies/builtin_policies.cuh"
#include "runner_set.hpp"

namespace moerunner::python {

namespace {
// Makes the tensors' device current for a call and restores the caller's, as torch's ops do;
// a host call (-1) touches nothing.
class device_guard {
 public:
  explicit device_guard(int device) {
    if (device < 0) return;
    MOE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MOE_CUDA_CHECK(cudaSetDevice(device));
    else previous_ = -1;
  }
  ~device_guard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = -1;
};
}  // namespace

std::unique_ptr<any_runner> make_runner(std::string_view backend, const MoeRunnerConfig& cfg) {
  return std::make_unique<runner_model<builtin_moe_runner<>, device_guard>>(backend, cfg);
}

std::vector<std::string> runner_backends() {
  std::vector<std::string> names;
  for (const auto& b : builtin::all) names.emplace_back(b.id.name());
  return names;
}

void device_topk(const tensor_view& logits, const tensor_view* bias, const topk_config& cfg, TopKOutput& out,
                 std::uintptr_t stream, int device) {
  const device_guard guard(device);
  gpu::topk(logits, bias, cfg, out, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace moerunner::python

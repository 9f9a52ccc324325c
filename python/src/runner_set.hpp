// What the bindings need from the runners this build compiled: the reference backend alone
// (runners_host.cpp, host compiler) or every built-in backend (runners_gpu.cu, nvcc). The
// bindings stay host code; one virtual call per run stands between them and the runner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <cuda/stream_ref>

#include "moerunner/moerunner.hpp"

namespace moerunner::python {

class any_runner {
 public:
  virtual ~any_runner() = default;
  virtual const MoeRunnerConfig& config() const = 0;
  virtual std::string_view backend() const = 0;
  virtual memory_space tensor_space() const = 0;
  // Whether a run waits on the host (a host backend computing in the call, or a device backend
  // that synchronizes, as cublas_grouped does): the binding then releases the GIL around it.
  virtual bool waits_on_host() const = 0;
  // The queries of a device backend plan for the current device, or for CUDA device `device`
  // (>= 0), made current for the query: the device a run's tensors are on.
  virtual std::size_t workspace_bytes(std::int64_t num_tokens, int device) const = 0;
  virtual std::size_t max_workspace_bytes(std::int64_t max_tokens, int device) const = 0;
  virtual std::string describe(std::int64_t num_tokens, int device) const = 0;
  // `device` is the CUDA device of the tensors (-1 for host tensors): made current for the run.
  virtual void run(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out,
                   workspace_view ws, std::uintptr_t stream, int device) = 0;
  virtual void run(const DispatchOutput& d, const fp8_block_quant_info& q, const tensor_view& out,
                   workspace_view ws, std::uintptr_t stream, int device) = 0;
  virtual void run(const DispatchOutput& d, const fp8_tensor_quant_info& q, const tensor_view& out,
                   workspace_view ws, std::uintptr_t stream, int device) = 0;
  virtual void run(const DispatchOutput& d, const fp8_channel_quant_info& q, const tensor_view& out,
                   workspace_view ws, std::uintptr_t stream, int device) = 0;
};

// A MoeRunner<...> behind any_runner; `Guard` makes a CUDA device current for a scope.
template <class Runner, class Guard>
class runner_model final : public any_runner {
 public:
  runner_model(std::string_view backend, const MoeRunnerConfig& cfg) : runner_(backend, cfg) {}
  const MoeRunnerConfig& config() const override { return runner_.config(); }
  std::string_view backend() const override { return runner_.runner_backend().name(); }
  memory_space tensor_space() const override { return runner_.tensor_space(); }
  bool waits_on_host() const override {
    return runner_.visit([](const auto& core) {
      using P = std::decay_t<decltype(core)>;
      if constexpr (P::tensor_space == memory_space::host) return true;
      else if constexpr (requires { P::graph_capturable; }) return !P::graph_capturable;
      else return true;  // not known to only enqueue work
    });
  }
  std::size_t workspace_bytes(std::int64_t m, int device) const override {
    const Guard guard(on_device(device));
    return runner_.workspace_bytes(m);
  }
  std::size_t max_workspace_bytes(std::int64_t m, int device) const override {
    const Guard guard(on_device(device));
    return runner_.max_workspace_bytes(m);
  }
  std::string describe(std::int64_t m, int device) const override {
    const Guard guard(on_device(device));
    return runner_.describe(m);
  }
  void run(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out, workspace_view ws,
           std::uintptr_t stream, int device) override {
    run_any(d, q, out, ws, stream, device);
  }
  void run(const DispatchOutput& d, const fp8_block_quant_info& q, const tensor_view& out, workspace_view ws,
           std::uintptr_t stream, int device) override {
    run_any(d, q, out, ws, stream, device);
  }
  void run(const DispatchOutput& d, const fp8_tensor_quant_info& q, const tensor_view& out, workspace_view ws,
           std::uintptr_t stream, int device) override {
    run_any(d, q, out, ws, stream, device);
  }
  void run(const DispatchOutput& d, const fp8_channel_quant_info& q, const tensor_view& out, workspace_view ws,
           std::uintptr_t stream, int device) override {
    run_any(d, q, out, ws, stream, device);
  }

 private:
  template <class QI>
  void run_any(const DispatchOutput& d, const QI& q, const tensor_view& out, workspace_view ws, std::uintptr_t stream,
               int device) {
    const Guard guard(on_device(device));
    runner_.run(d, q, out, ws, cuda::stream_ref(reinterpret_cast<cudaStream_t>(stream)));
  }

  // The device a guard makes current: none for a host backend, which touches no device (device
  // arrays are its validation's to refuse).
  int on_device(int device) const { return runner_.tensor_space() == memory_space::device ? device : -1; }

  Runner runner_;
};

// Defined by the runner-set translation unit the build compiled.
std::unique_ptr<any_runner> make_runner(std::string_view backend, const MoeRunnerConfig& cfg);
// The backends make_runner can build, in the built-in list's order.
std::vector<std::string> runner_backends();
// gpu::topk on `stream` with `device` current; unsupported_error in a build without CUDA.
void device_topk(const tensor_view& logits, const tensor_view* bias, const topk_config& cfg, TopKOutput& out,
                 std::uintptr_t stream, int device);

}  // namespace moerunner::python

// The `cublas_grouped` backend: the MoE runner core built the way an engine author
// would build it from NVIDIA's library, the baseline the fused backend is measured against.
//
// Pipeline (bf16 or f16 in, f32 accumulate):
//   routing plan (device counts, offsets, slot order) -> gather rows in expert order
//   -> [apply_router_weight_on_input: scale each row by its weight]
//   -> GEMM1 cublasGemmGroupedBatchedEx, one group per expert with tokens: [n_e, H] x w13[e]^T -> [n_e, 2I]
//   -> [+ b13[e]] -> gated activation (gate/up columns in w13's layout)
//   -> GEMM2 grouped: [n_e, I] x w2[e]^T -> [n_e, H] -> [+ b2[e]]
//   -> combine each token's k rows times its router weights (and routed_scaling_factor
//      when the weights do not already carry it), or leave them as [M, k, H] with no_combine.
//
// Synchronization (the one built-in backend that has it): cuBLAS's grouped GEMM takes each
// group's m, n, k in HOST arrays, so every run copies the E+1 expert offsets to pinned host
// memory and waits for the stream once, between building the routing plan and the first GEMM.
// Hence this backend is NOT CUDA-graph capturable (graph_capturable = false; a run on a
// capturing stream throws unsupported_error) and it blocks the calling thread for the
// routing kernels. Engines that capture graphs use the fused backend.
//
// Memory: everything on the device comes from the caller's workspace (workspace_bytes),
// including cuBLAS's own workspace and the per-group device pointer arrays; the policy owns
// only a cuBLAS handle, a small pinned host staging buffer and one event, all made in the
// constructor (never at static-initialization time).
//
// The same wait lets this backend reject an expert id outside [-1, num_local_experts)
// before anything is written to the output.
//
// batch_invariant is refused when the policy is built: cuBLAS's kernel choice follows the
// per-expert row counts.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/policies/cublas_grouped_policy.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <cublas_v2.h>
#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include "moerunner/core/concepts.hpp"
#include "moerunner/core/config.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/gpu/activation.cuh"
#include "moerunner/gpu/combine.cuh"
#include "moerunner/gpu/cublas_check.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/expert_bias.cuh"
#include "moerunner/gpu/gather.cuh"
#include "moerunner/gpu/permute.cuh"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/gpu/scale_rows.cuh"
#include "moerunner/runner/validate.hpp"

namespace moerunner {

namespace cublas_grouped_detail {

struct handle_deleter {
  void operator()(cublasHandle_t h) const noexcept { cublasDestroy(h); }
};
struct pinned_deleter {
  void operator()(void* p) const noexcept { cudaFreeHost(p); }
};
struct event_deleter {
  void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
};

inline constexpr std::size_t piece_alignment = 256;

constexpr std::size_t round_up(std::size_t n) { return (n + piece_alignment - 1) / piece_alignment * piece_alignment; }

// Hands out consecutive 256-byte-aligned pieces of the caller's workspace; the start is
// aligned here (workspace_bytes includes the slack), so any workspace pointer will do.
class workspace_carver {
 public:
  explicit workspace_carver(workspace_view ws) : base_(static_cast<char*>(ws.data)), bytes_(ws.bytes) {
    const auto addr = reinterpret_cast<std::uintptr_t>(base_);
    used_ = static_cast<std::size_t>(round_up(addr) - addr);
  }
  void* take(std::size_t n) {
    n = round_up(n);
    MOE_EXPECT(used_ + n <= bytes_, "cublas_grouped_policy", "workspace too small (ask workspace_bytes)");
    void* p = base_ + used_;
    used_ += n;
    return p;
  }

 private:
  char* base_;
  std::size_t bytes_;
  std::size_t used_ = 0;
};

// The per-group device pointers the grouped GEMMs read: A, B, C for GEMM1 then GEMM2.
inline constexpr int pointer_arrays = 6;

}  // namespace cublas_grouped_detail

// One run at a time per object: the cuBLAS size arrays and the pinned staging are members.
class cublas_grouped_policy {
 public:
  static constexpr std::string_view name = "cublas_grouped";
  static constexpr memory_space tensor_space = memory_space::device;
  using quant_infos = quant_info_list<unquantized_quant_info>;
  // Each run waits for the expert offsets on the host (see the header comment).
  static constexpr bool graph_capturable = false;
  // Activations and weights move through the workspace at this width (bf16 / f16).
  static constexpr std::size_t element_bytes = 2;

  explicit cublas_grouped_policy(const MoeRunnerConfig& cfg) : cfg_(cfg) {
    // cuBLAS picks its kernels (and any split of K) from the group sizes, which follow the batch.
    if (cfg_.batch_invariant())
      throw unsupported_error("cublas_grouped_policy: batch_invariant is not supported (cuBLAS picks its GEMM "
                              "kernels from the per-expert row counts, so a token's bits can follow its batch); "
                              "use cuda_fused or reference");
    const int e = cfg_.num_local_experts();
    cublasHandle_t h = nullptr;
    MOE_CUBLAS_CHECK(cublasCreate(&h));
    handle_.reset(h);
    MOE_CUBLAS_CHECK(cublasSetPointerMode(handle_.get(), CUBLAS_POINTER_MODE_HOST));

    int device = 0, major = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    // cuBLAS's guidance: 32 MiB of workspace on Hopper and later, 4 MiB before.
    cublas_workspace_bytes_ = major >= 9 ? (std::size_t{32} << 20) : (std::size_t{4} << 20);

    void* pinned = nullptr;
    MOE_CUDA_CHECK(cudaMallocHost(&pinned, pinned_bytes(e)));
    pinned_.reset(pinned);
    cudaEvent_t ev = nullptr;
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    staging_done_.reset(ev);

    // Host arrays for cuBLAS; only n (tokens per group) changes from run to run.
    op_t_.assign(e, CUBLAS_OP_T);
    op_n_.assign(e, CUBLAS_OP_N);
    n_.assign(e, 0);
    ones_.assign(e, 1);
    w13_rows_.assign(e, cfg_.w13_rows());
    hidden_.assign(e, cfg_.hidden_size());
    inter_.assign(e, cfg_.intermediate_size());
    alpha_.assign(e, 1.0f);
    beta_.assign(e, 0.0f);
  }

  // Alignment slack + plan + gathered rows (reused for GEMM2's output) + GEMM1 output
  // + activation + pointer arrays + cuBLAS workspace, each in a 256-byte-aligned piece.
  std::size_t workspace_bytes(std::int64_t num_tokens) const {
    using cublas_grouped_detail::round_up;
    const auto slots = static_cast<std::size_t>(num_tokens) * static_cast<std::size_t>(cfg_.top_k());
    const auto e = static_cast<std::size_t>(cfg_.num_local_experts());
    return cublas_grouped_detail::piece_alignment +
           round_up(gpu::routing_plan_bytes(num_tokens, cfg_.top_k(), cfg_.num_local_experts())) +
           round_up(slots * cfg_.hidden_size() * element_bytes) +
           round_up(slots * cfg_.w13_rows() * element_bytes) +
           round_up(slots * cfg_.intermediate_size() * element_bytes) +
           round_up(cublas_grouped_detail::pointer_arrays * e * sizeof(void*)) + cublas_workspace_bytes_;
  }

  CombineInput run_from_dispatch(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out,
                                 workspace_view ws, cuda::stream_ref stream_ref) {
    constexpr const char* where = "cublas_grouped_policy";
    detail::validate_dispatch(cfg_, d, out, tensor_space, where);
    detail::validate_quant_info(cfg_, q, tensor_space, where);
    const dtype type = d.hidden_states.type;
    MOE_EXPECT(type == dtype::bf16 || type == dtype::f16, where,
               "hidden_states must be bf16 or f16 (cuBLAS grouped GEMM path), got " + std::string(dtype_name(type)));
    MOE_EXPECT(q.w13.type == type, where,
               "w13 and w2 must have the dtype of hidden_states (" + std::string(dtype_name(type)) + "), got " +
                   std::string(dtype_name(q.w13.type)));
    // The biases are f32 or the weights' dtype (validate_quant_info), which is hidden_states'.
    const std::int64_t m = d.num_tokens();
    MOE_EXPECT(m * cfg_.top_k() <= 0x7fffffff, where, "num_tokens * top_k must fit in 32 bits for cuBLAS");
    detail::validate_workspace(workspace_bytes(m), ws, where);
    const CombineInput result{out, !cfg_.no_combine()};
    if (m == 0) return result;

    const cudaStream_t stream = stream_ref.get();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone)
      throw unsupported_error(
          "backend 'cublas_grouped' is not CUDA-graph capturable: cuBLAS grouped GEMM needs the per-expert token "
          "counts on the host, so each run waits for the stream; run it outside capture or use 'cuda_fused'");

    const int e_local = cfg_.num_local_experts();
    const int hidden = cfg_.hidden_size(), inter = cfg_.intermediate_size(), rows13 = cfg_.w13_rows();
    const auto slots = static_cast<std::size_t>(m) * static_cast<std::size_t>(cfg_.top_k());

    cublas_grouped_detail::workspace_carver carve(ws);
    const std::size_t plan_bytes = cublas_grouped_detail::round_up(gpu::routing_plan_bytes(m, cfg_.top_k(), e_local));
    void* plan_ws = carve.take(plan_bytes);
    auto* rows = static_cast<char*>(carve.take(slots * hidden * element_bytes));
    auto* gemm1_out = static_cast<char*>(carve.take(slots * rows13 * element_bytes));
    auto* act = static_cast<char*>(carve.take(slots * inter * element_bytes));
    auto* dev_ptrs = static_cast<void**>(
        carve.take(cublas_grouped_detail::pointer_arrays * static_cast<std::size_t>(e_local) * sizeof(void*)));
    void* cublas_ws = carve.take(cublas_workspace_bytes_);

    // The previous run's pointer upload may still be reading the pinned staging buffer.
    MOE_CUDA_CHECK(cudaEventSynchronize(staging_done_.get()));

    const gpu::routing_plan plan =
        gpu::build_routing_plan(d.topk.topk_ids, e_local, plan_ws, plan_bytes, stream);

    // The one host round trip of this backend: expert offsets and the bad-id flag.
    std::int32_t* host_offsets = pinned_offsets();
    std::int32_t* host_flag = host_offsets + e_local + 1;
    MOE_CUDA_CHECK(cudaMemcpyAsync(host_offsets, plan.expert_offsets, sizeof(std::int32_t) * (e_local + 1),
                                   cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_CHECK(
        cudaMemcpyAsync(host_flag, plan.error_flag, sizeof(std::int32_t), cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    MOE_EXPECT(*host_flag == 0, where,
               "topk_ids holds an expert id outside [-1, num_local_experts=" + std::to_string(e_local) + ")");

    gpu::gather_rows(d.hidden_states, plan, rows, stream);
    if (cfg_.apply_router_weight_on_input())
      gpu::scale_rows_by_weight(rows, type, hidden, plan, d.topk.topk_weights.ptr<const float>(), stream);

    // One group per expert that received tokens; empty experts are skipped entirely. The six
    // pointer arrays (A, B, C of each GEMM) sit E entries apart in staging and on the device.
    void** staging = pinned_pointers();
    const auto stride = static_cast<std::size_t>(e_local);
    const auto* w13 = static_cast<const char*>(q.w13.data);
    const auto* w2 = static_cast<const char*>(q.w2.data);
    int groups = 0;
    for (int e = 0; e < e_local; ++e) {
      const std::int32_t count = host_offsets[e + 1] - host_offsets[e];
      if (count <= 0) continue;
      const auto begin = static_cast<std::size_t>(host_offsets[e]);
      const auto ex = static_cast<std::size_t>(e);
      const auto g = static_cast<std::size_t>(groups);
      n_[g] = count;
      staging[0 * stride + g] = const_cast<char*>(w13 + ex * rows13 * hidden * element_bytes);
      staging[1 * stride + g] = rows + begin * hidden * element_bytes;
      staging[2 * stride + g] = gemm1_out + begin * rows13 * element_bytes;
      staging[3 * stride + g] = const_cast<char*>(w2 + ex * hidden * inter * element_bytes);
      staging[4 * stride + g] = act + begin * inter * element_bytes;
      staging[5 * stride + g] = rows + begin * hidden * element_bytes;  // GEMM1 has consumed the gathered rows
      ++groups;
    }
    if (groups > 0) {
      MOE_CUDA_CHECK(cudaMemcpyAsync(dev_ptrs, staging, sizeof(void*) * cublas_grouped_detail::pointer_arrays * stride,
                                     cudaMemcpyHostToDevice, stream));
      MOE_CUDA_CHECK(cudaEventRecord(staging_done_.get(), stream));

      MOE_CUBLAS_CHECK(cublasSetStream(handle_.get(), stream));
      // cublasSetStream resets the workspace to cuBLAS's own pool; use the caller's memory instead.
      MOE_CUBLAS_CHECK(cublasSetWorkspace(handle_.get(), cublas_ws, cublas_workspace_bytes_));
      const cudaDataType_t dt = type == dtype::bf16 ? CUDA_R_16BF : CUDA_R_16F;
      void** p = dev_ptrs;
      // Row-major [n, N] = X [n, K] * W^T is column-major C^T [N, n] = W [N, K] (as op T) * X^T.
      MOE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
          handle_.get(), op_t_.data(), op_n_.data(), w13_rows_.data(), n_.data(), hidden_.data(), alpha_.data(),
          p, dt, hidden_.data(), p + stride, dt, hidden_.data(), beta_.data(), p + 2 * stride, dt,
          w13_rows_.data(), groups, ones_.data(), CUBLAS_COMPUTE_32F));
      if (!q.b13.empty_view()) gpu::add_expert_bias(gemm1_out, type, rows13, q.b13, plan, stream);
      gpu::gated_activation(gemm1_out, act, type, inter, cfg_.is_gated(), cfg_.act(), plan, stream,
                            cfg_.gate_up_layout());
      MOE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
          handle_.get(), op_t_.data(), op_n_.data(), hidden_.data(), n_.data(), inter_.data(), alpha_.data(),
          p + 3 * stride, dt, inter_.data(), p + 4 * stride, dt, inter_.data(), beta_.data(), p + 5 * stride, dt,
          hidden_.data(), groups, ones_.data(), CUBLAS_COMPUTE_32F));
      if (!q.b2.empty_view()) gpu::add_expert_bias(rows, type, hidden, q.b2, plan, stream);
    }

    const float scale = d.topk.routed_scaling_applied ? 1.0f : cfg_.routed_scaling_factor();
    const float* weights = cfg_.apply_router_weight_on_input() ? nullptr : d.topk.topk_weights.ptr<const float>();
    gpu::combine_rows(rows, type, plan, weights, scale, out, cfg_.no_combine(), stream);
    return result;
  }

 private:
  static std::size_t pinned_bytes(int e) {
    return cublas_grouped_detail::round_up(cublas_grouped_detail::pointer_arrays * static_cast<std::size_t>(e) *
                                           sizeof(void*)) +
           sizeof(std::int32_t) * (static_cast<std::size_t>(e) + 2);
  }
  void** pinned_pointers() const { return static_cast<void**>(pinned_.get()); }
  std::int32_t* pinned_offsets() const {
    return reinterpret_cast<std::int32_t*>(
        static_cast<char*>(pinned_.get()) +
        cublas_grouped_detail::round_up(cublas_grouped_detail::pointer_arrays *
                                        static_cast<std::size_t>(cfg_.num_local_experts()) * sizeof(void*)));
  }

  MoeRunnerConfig cfg_;
  std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, cublas_grouped_detail::handle_deleter> handle_;
  std::unique_ptr<void, cublas_grouped_detail::pinned_deleter> pinned_;
  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, cublas_grouped_detail::event_deleter> staging_done_;
  std::size_t cublas_workspace_bytes_ = 0;
  std::vector<cublasOperation_t> op_t_, op_n_;
  std::vector<int> n_, ones_, w13_rows_, hidden_, inter_;
  std::vector<float> alpha_, beta_;
};

static_assert(explain_dispatch_runner_core<cublas_grouped_policy>());
static_assert(!std::is_polymorphic_v<cublas_grouped_policy>);

}  // namespace moerunner

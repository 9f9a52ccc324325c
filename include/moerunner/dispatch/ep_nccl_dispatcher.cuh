// Expert-parallel dispatch and combine across GPUs through NCCL: each of R ranks (one GPU each)
// holds E/R experts and routes its own M tokens; dispatch brings every rank the rows its experts
// need, the local runner (num_local_experts = E/R) runs on them, and combine returns each
// row's weighted part to its token's rank, which sums the parts in rank order. The same
// contract, layouts and results as ep_host_dispatcher (dispatch/ep_host_dispatcher.hpp), the
// host reference, and the index arithmetic of dispatch/ep_layout.hpp.
//
//   ep_params p{.mode = ep_mode::low_latency, .max_tokens_per_rank = 128};
//   ep_buffer_layout l = ep_nccl_dispatcher::layout_for(R, cfg, dtype::bf16, p);  // l.bytes of device memory
//   ep_nccl_dispatcher disp(comm, cfg, dtype::bf16, p, {workspace, l.bytes});
//   DispatchOutput d = disp.dispatch(x, topk, stream, status);   // rows [d.num_tokens(), H], local ids
//   CombineInput c = runner.run(d, local_weights, parts, ws, stream);  // parts [d.num_tokens(), H]
//   disp.combine(c, out, stream);                                 // out [M, H]
//
// Modes (ep_mode), all on the caller's stream:
//   throughput (prefill): the send lists and their counts are built on the device, the counts
//     exchanged on the device (grouped ncclSend/ncclRecv of one int64 per pair); then the host
//     waits for the stream ONCE per layer, in dispatch, because NCCL takes its message sizes
//     from the host; then exactly the rows each rank needs move by grouped ncclSend/ncclRecv.
//     combine reuses those counts and does not wait. Not graph capturable (a capturing stream
//     is refused with unsupported_error).
//   low_latency (decode): every (source, destination) pair has a fixed slot of `capacity` rows
//     (ep_params; make_ep_low_latency_size), so every NCCL size is known from the config: no
//     host synchronization, CUDA-graph capturable. The local runner gets R * capacity rows, the
//     unused ones routed nowhere (ids -1). A list longer than the capacity keeps its first
//     `capacity` tokens and counts the rest in ep_status (core/types.hpp), never writing past
//     a buffer. Whole slots travel whatever their fill.
//   allgather: every rank all-gathers all ranks' rows and routing (max_tokens_per_rank rows each,
//     the unused ones routed nowhere), runs its experts over all of them and reduce-scatters
//     the parts (ncclReduceScatter, sum in the parts' dtype in NCCL's order: rank order and one
//     rounding only for R <= 2). No host synchronization, graph capturable.
//
// The constructor, dispatch and combine are collective: every rank calls them, in the same order,
// and never inside the caller's own ncclGroupStart/End (each call's transfers must complete in
// its group). Every rank builds its dispatcher with the same config, dtype and ep_params: the
// constructor compares them across the ranks and every rank throws on a difference (or on any
// rank's failed checks) instead of hanging later. Between a dispatch and its combine the
// workspace holds the send lists; a second dispatch on the same dispatcher before the combine
// overwrites them. Memory: the workspace (layout_for(...).bytes, device memory of the
// communicator's GPU, owned by the caller); the dispatcher allocates none after its constructor.
// Rows, parts and the output are of the dtype given at construction (f32, f16 or bf16).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/dispatch/ep_nccl_dispatcher.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "moerunner/core/config.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/dispatch/ep_agreement.hpp"
#include "moerunner/dispatch/ep_buffers.hpp"
#include "moerunner/dispatch/ep_layout.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/ep_pack.cuh"
#include "moerunner/gpu/nccl_check.hpp"

namespace moerunner {

class ep_nccl_dispatcher {
 public:
  // The workspace layout (its size: .bytes) for a world of world_size ranks; cfg is the local
  // runner's config (num_experts = E, num_local_experts = E / world_size). Throws
  // invalid_argument_error where world_size does not divide the experts.
  static ep_buffer_layout layout_for(int world_size, const MoeRunnerConfig& cfg, dtype type, const ep_params& p) {
    constexpr const char* where = "ep_nccl_dispatcher::layout_for";
    const ep_topology topo{world_size, 0, cfg.num_experts()};
    check_config(topo, cfg, where);
    return make_ep_buffer_layout(topo, cfg.top_k(), cfg.hidden_size(), type, p, where);
  }

  // Collective: every rank builds its dispatcher, once, with the same config, dtype and ep_params.
  // The ranks gather what each was built with (64 bytes per rank, through a device buffer held for
  // the call) and every rank throws if any rank's own checks failed or any differs, rather than
  // leaving the others to hang in a transfer sized otherwise. A null communicator, or one whose
  // GPU is not the current device, is refused before the exchange (on that rank alone).
  ep_nccl_dispatcher(ncclComm_t comm, const MoeRunnerConfig& cfg, dtype type, const ep_params& p, workspace_view ws)
      : comm_(comm), cfg_(cfg), type_(type), params_(p) {
    constexpr const char* where = "ep_nccl_dispatcher";
    MOE_EXPECT(comm != nullptr, where, "comm is null");
    int size = 0, rank = 0, comm_device = 0, device = 0;
    MOE_NCCL_CHECK(ncclCommCount(comm, &size));
    MOE_NCCL_CHECK(ncclCommUserRank(comm, &rank));
    MOE_NCCL_CHECK(ncclCommCuDevice(comm, &comm_device));
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_EXPECT(comm_device == device, where,
               "the communicator's GPU (" + std::to_string(comm_device) + ") is not the current device (" +
                   std::to_string(device) + ")");
    topo_ = {size, rank, cfg.num_experts()};
    // This rank's own checks, kept until every rank has said how its checks went.
    std::exception_ptr own_error;
    try {
      check_config(topo_, cfg, where);
      layout_ = make_ep_buffer_layout(topo_, cfg.top_k(), cfg.hidden_size(), type, p, where);
      check_workspace(ws, device, where);
    } catch (const moe_error&) {
      own_error = std::current_exception();
    }
    const std::vector<ep_agreement> all =
        gather_agreement(own_error ? failed_ep_agreement() : make_ep_agreement(cfg.num_experts(), type, layout_));
    if (own_error) std::rethrow_exception(own_error);
    check_ep_agreement(all, where);
    ws_ = static_cast<char*>(ws.data);
    host_counts_.assign(2 * static_cast<std::size_t>(size), 0);
    // Rows no token fills (low_latency's slot tails, allgather's rows past a rank's M) travel
    // and reach the runner routed nowhere: zeroed once here, so NCCL never sends uninitialized
    // bytes. On the legacy stream, waited for: a dispatch on any stream comes after.
    if (params_.mode != ep_mode::throughput) {
      if (params_.mode == ep_mode::low_latency)
        MOE_CUDA_CHECK(cudaMemset(ws_ + layout_.send_rows, 0, layout_.send_meta - layout_.send_rows));
      MOE_CUDA_CHECK(cudaMemset(ws_ + layout_.recv_rows, 0, layout_.recv_meta - layout_.recv_rows));
      MOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    }
  }

  const ep_topology& topology() const { return topo_; }
  const ep_buffer_layout& layout() const { return layout_; }
  ep_mode mode() const { return params_.mode; }

  // Sends each token's row (hidden_states [M, H], M <= max_tokens_per_rank) and its routing
  // (device topk_ids / topk_weights [M, k], global ids) to the ranks owning its experts; returns
  // the rows this rank's runner takes with their routing in local ids (-1 where another rank
  // owns the expert), every source in rank order. The views point into the workspace and stay
  // valid until the next dispatch. status (low_latency; device memory, 4-byte aligned, or null)
  // counts the rows a full slot left out.
  DispatchOutput dispatch(const tensor_view& hidden_states, const TopKOutput& topk, cuda::stream_ref stream_ref,
                          ep_status* status = nullptr) {
    constexpr const char* where = "ep_nccl_dispatcher::dispatch";
    const int k = cfg_.top_k(), h = cfg_.hidden_size();
    check::dense(hidden_states, 2, type_, memory_space::device, where, "hidden_states");
    check::dim(hidden_states, 1, h, where, "hidden_states");
    check::aligned(hidden_states, dtype_size(type_), where, "hidden_states");
    const std::int64_t m = hidden_states.shape[0];
    MOE_EXPECT(m <= layout_.max_tokens, where,
               "hidden_states has " + std::to_string(m) + " tokens, more than max_tokens_per_rank = " +
                   std::to_string(layout_.max_tokens));
    check::dense(topk.topk_ids, 2, dtype::i32, memory_space::device, where, "topk_ids");
    check::dense(topk.topk_weights, 2, dtype::f32, memory_space::device, where, "topk_weights");
    for (const tensor_view* t : {&topk.topk_ids, &topk.topk_weights}) {
      const char* what = t == &topk.topk_ids ? "topk_ids" : "topk_weights";
      check::dim(*t, 0, m, where, what);
      check::dim(*t, 1, k, where, what);
      check::aligned(*t, 4, where, what);
    }
    MOE_EXPECT(reinterpret_cast<std::uintptr_t>(status) % 4 == 0, where, "status must be 4-byte aligned");
    check_device(where);
    if (status != nullptr && status != checked_status_) {  // asked once per pointer (legal while capturing)
      cudaPointerAttributes attr{};
      MOE_CUDA_CHECK(cudaPointerGetAttributes(&attr, status));
      MOE_EXPECT(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged, where,
                 "status must be device memory (the pack kernel counts into it)");
      checked_status_ = status;
    }
    const cudaStream_t stream = stream_ref.get();
    const auto* ids = topk.topk_ids.ptr<const std::int32_t>();
    const auto* weights = topk.topk_weights.ptr<const float>();
    switch (params_.mode) {
      case ep_mode::throughput: dispatch_throughput(hidden_states.data, ids, weights, m, stream); break;
      case ep_mode::low_latency: dispatch_low_latency(hidden_states.data, ids, weights, m, status, stream); break;
      case ep_mode::allgather: dispatch_allgather(hidden_states.data, ids, weights, m, stream); break;
    }
    tokens_ = m;
    dispatched_ = true;
    const auto dev = memory_space::device;
    return {tensor_view::contiguous(ws_ + layout_.recv_rows, type_, {rows_, h}, dev),
            {},
            {tensor_view::contiguous(ws_ + layout_.weights, dtype::f32, {rows_, k}, dev),
             tensor_view::contiguous(ws_ + layout_.ids, dtype::i32, {rows_, k}, dev), topk.routed_scaling_applied}};
  }

  // Returns each part (c: [rows, H] as the local runner combined the rows dispatch returned) to
  // its token's rank and writes out [M, H] = the sum of the token's parts in rank order
  // (allgather: in the reduce-scatter's order).
  void combine(const CombineInput& c, const tensor_view& out, cuda::stream_ref stream_ref) {
    constexpr const char* where = "ep_nccl_dispatcher::combine";
    MOE_EXPECT(dispatched_, where, "no dispatch to combine");
    MOE_EXPECT(c.combined, where, "the local runner must combine its rows (no_combine is not taken)");
    const int h = cfg_.hidden_size();
    check::dense(c.hidden_states, 2, type_, memory_space::device, where, "parts");
    check::dim(c.hidden_states, 0, rows_, where, "parts");
    check::dim(c.hidden_states, 1, h, where, "parts");
    check::aligned(c.hidden_states, dtype_size(type_), where, "parts");
    check::dense(out, 2, type_, memory_space::device, where, "out");
    check::dim(out, 0, tokens_, where, "out");
    check::dim(out, 1, h, where, "out");
    check::aligned(out, dtype_size(type_), where, "out");
    check_device(where);
    const cudaStream_t stream = stream_ref.get();
    const auto* parts = static_cast<const char*>(c.hidden_states.data);
    const std::int64_t rb = layout_.row_bytes;
    const int r = topo_.world_size;
    char* back = ws_ + layout_.back;
    switch (params_.mode) {
      case ep_mode::throughput: {
        nccl_group g;
        for (int p = 0; p < r; ++p) {
          if (recv_count(p) > 0) send(parts + recv_off_[p] * rb, recv_count(p) * rb, p, stream);
          if (send_count(p) > 0) recv(back + send_off_[p] * rb, send_count(p) * rb, p, stream);
        }
        g.end();
        gpu::ep_reduce(back, send_pos(), counts(), 0, r, out, stream);
        break;
      }
      case ep_mode::low_latency: {
        const std::int64_t slot = layout_.slots * rb;
        nccl_group g;
        for (int p = 0; p < r; ++p) {
          send(parts + p * slot, slot, p, stream);
          recv(back + p * slot, slot, p, stream);
        }
        g.end();
        gpu::ep_reduce(back, send_pos(), counts(), layout_.slots, r, out, stream);
        break;
      }
      case ep_mode::allgather: {
        MOE_NCCL_CHECK(ncclReduceScatter(parts, back, static_cast<std::size_t>(layout_.max_tokens * h), nccl_type(),
                                         ncclSum, comm_, stream));
        if (tokens_ > 0)
          MOE_CUDA_CHECK(cudaMemcpyAsync(out.data, back, static_cast<std::size_t>(tokens_ * rb),
                                         cudaMemcpyDeviceToDevice, stream));
        break;
      }
    }
  }

 private:
  // ncclGroupStart now, ncclGroupEnd at end() (checked) or, after a throw, on destruction.
  class nccl_group {
   public:
    nccl_group() { MOE_NCCL_CHECK(ncclGroupStart()); }
    nccl_group(const nccl_group&) = delete;
    nccl_group& operator=(const nccl_group&) = delete;
    ~nccl_group() {
      if (open_) ncclGroupEnd();
    }
    void end() {
      open_ = false;
      MOE_NCCL_CHECK(ncclGroupEnd());
    }

   private:
    bool open_ = true;
  };

  void check_workspace(const workspace_view& ws, int device, const char* where) const {
    MOE_EXPECT(ws.data != nullptr, where, "the workspace is null");
    MOE_EXPECT(ws.bytes >= layout_.bytes, where,
               "the workspace has " + std::to_string(ws.bytes) + " bytes, the layout needs " +
                   std::to_string(layout_.bytes) + " (ep_nccl_dispatcher::layout_for)");
    MOE_EXPECT(reinterpret_cast<std::uintptr_t>(ws.data) % 256 == 0, where,
               "the workspace must be 256-byte aligned (cudaMalloc's alignment)");
    cudaPointerAttributes attr{};
    MOE_CUDA_CHECK(cudaPointerGetAttributes(&attr, ws.data));
    MOE_EXPECT(attr.type == cudaMemoryTypeDevice && attr.device == device, where,
               "the workspace must be device memory of the communicator's GPU");
  }

  // Every rank's agreement words, rank by rank: an all-gather through a device buffer of this
  // call's own (the workspace may be what a rank's checks refused), on a stream of its own,
  // waited for.
  std::vector<ep_agreement> gather_agreement(const ep_agreement& mine) const {
    const int r = topo_.world_size;
    std::vector<ep_agreement> all(static_cast<std::size_t>(r));
    constexpr std::size_t words_bytes = sizeof(ep_agreement);
    struct device_buffer {
      void* p = nullptr;
      ~device_buffer() { cudaFree(p); }
    } buf;
    struct own_stream {
      cudaStream_t s = nullptr;
      ~own_stream() {
        if (s != nullptr) cudaStreamDestroy(s);
      }
    } st;
    MOE_CUDA_CHECK(cudaMalloc(&buf.p, words_bytes * static_cast<std::size_t>(r)));
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st.s, cudaStreamNonBlocking));
    auto* slots = static_cast<char*>(buf.p);
    char* own = slots + words_bytes * static_cast<std::size_t>(topo_.rank);
    MOE_CUDA_CHECK(cudaMemcpyAsync(own, mine.data(), words_bytes, cudaMemcpyHostToDevice, st.s));
    MOE_NCCL_CHECK(ncclAllGather(own, slots, ep_agreement_words, ncclInt64, comm_, st.s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(all.data(), slots, words_bytes * static_cast<std::size_t>(r),
                                   cudaMemcpyDeviceToHost, st.s));
    MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    return all;
  }

  static void check_config(const ep_topology& topo, const MoeRunnerConfig& cfg, const char* where) {
    topo.validate(where);
    MOE_EXPECT(cfg.num_local_experts() == topo.experts_per_rank(), where,
               "num_local_experts must be num_experts / world size = " + std::to_string(topo.experts_per_rank()) +
                   ", got " + std::to_string(cfg.num_local_experts()));
    MOE_EXPECT(!cfg.no_combine(), where, "expert parallelism combines every token's rows (no_combine is not taken)");
  }

  void check_device(const char* where) const {
    int device = 0, comm_device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_NCCL_CHECK(ncclCommCuDevice(comm_, &comm_device));
    MOE_EXPECT(device == comm_device, where,
               "the current device (" + std::to_string(device) + ") is not the communicator's GPU (" +
                   std::to_string(comm_device) + ")");
  }

  ncclDataType_t nccl_type() const {
    switch (type_) {
      case dtype::bf16: return ncclBfloat16;
      case dtype::f16: return ncclFloat16;
      default: return ncclFloat32;  // validated: f32
    }
  }

  void send(const void* p, std::int64_t bytes, int peer, cudaStream_t s) {
    MOE_NCCL_CHECK(ncclSend(p, static_cast<std::size_t>(bytes), ncclUint8, peer, comm_, s));
  }
  void recv(void* p, std::int64_t bytes, int peer, cudaStream_t s) {
    MOE_NCCL_CHECK(ncclRecv(p, static_cast<std::size_t>(bytes), ncclUint8, peer, comm_, s));
  }

  std::int32_t* send_pos() const { return reinterpret_cast<std::int32_t*>(ws_ + layout_.send_pos); }
  std::int32_t* send_token() const { return reinterpret_cast<std::int32_t*>(ws_ + layout_.send_token); }
  // Device counts: [0, R) sent to each rank, [R, 2R) received from each.
  std::int64_t* counts() const { return reinterpret_cast<std::int64_t*>(ws_ + layout_.counts); }
  std::int32_t* send_meta() const { return reinterpret_cast<std::int32_t*>(ws_ + layout_.send_meta); }
  std::int32_t* recv_meta() const { return reinterpret_cast<std::int32_t*>(ws_ + layout_.recv_meta); }
  std::int32_t* local_ids() const { return reinterpret_cast<std::int32_t*>(ws_ + layout_.ids); }
  float* local_weights() const { return reinterpret_cast<float*>(ws_ + layout_.weights); }
  std::int64_t send_count(int p) const { return host_counts_[p]; }
  std::int64_t recv_count(int p) const { return host_counts_[topo_.world_size + p]; }

  // Each rank's count to every rank (one int64 per pair, device to device), inside a group.
  void exchange_counts(cudaStream_t stream) {
    for (int p = 0; p < topo_.world_size; ++p) {
      MOE_NCCL_CHECK(ncclSend(counts() + p, 1, ncclInt64, p, comm_, stream));
      MOE_NCCL_CHECK(ncclRecv(counts() + topo_.world_size + p, 1, ncclInt64, p, comm_, stream));
    }
  }

  gpu::ep_pack_args pack_args(const void* x, const std::int32_t* ids, const float* weights, std::int64_t m) const {
    gpu::ep_pack_args a;
    a.tokens = m;
    a.x = x;
    a.ids = ids;
    a.weights = weights;
    a.k = cfg_.top_k();
    a.world = topo_.world_size;
    a.send_token = send_token();
    a.token_stride = layout_.max_tokens;
    a.send_counts = counts();
    a.row_bytes = layout_.row_bytes;
    a.send_rows = ws_ + layout_.send_rows;
    a.send_meta = send_meta();
    return a;
  }

  void dispatch_throughput(const void* x, const std::int32_t* ids, const float* weights, std::int64_t m,
                           cudaStream_t stream) {
    constexpr const char* where = "ep_nccl_dispatcher::dispatch";
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone)
      throw unsupported_error(std::string(where) +
                              ": mode throughput is not CUDA-graph capturable (NCCL takes its message sizes from the "
                              "host, so dispatch waits for the exchanged counts); use low_latency or allgather");
    const int r = topo_.world_size, k = cfg_.top_k();
    gpu::ep_send_positions(ids, m, k, topo_, send_pos(), send_token(), layout_.max_tokens, counts(), stream);
    {
      nccl_group g;
      exchange_counts(stream);
      g.end();
    }
    MOE_CUDA_CHECK(cudaMemcpyAsync(host_counts_.data(), counts(), host_counts_.size() * sizeof(std::int64_t),
                                   cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // the one wait of the mode: NCCL needs the sizes
    std::vector<std::int64_t> sent(host_counts_.begin(), host_counts_.begin() + r);
    std::vector<std::int64_t> got(host_counts_.begin() + r, host_counts_.end());
    std::int64_t most = 0;
    for (int p = 0; p < r; ++p) {
      MOE_EXPECT(got[p] >= 0 && got[p] <= layout_.max_tokens, where,
                 "rank " + std::to_string(p) + " sends " + std::to_string(got[p]) +
                     " rows, more than max_tokens_per_rank = " + std::to_string(layout_.max_tokens) +
                     " (every rank must use the same ep_params)");
      most = std::max(most, got[p]);
    }
    send_off_ = make_ep_recv_layout(sent).offsets;  // the same prefix sums, over what this rank sends
    recv_off_ = make_ep_recv_layout(got).offsets;
    rows_ = recv_off_.back();
    gpu::ep_pack_args a = pack_args(x, ids, weights, m);
    a.rows_per_dest = m;
    gpu::ep_pack_rows(a, stream);
    const std::int64_t rb = layout_.row_bytes, mb = static_cast<std::int64_t>(layout_.meta_words()) * 4;
    char* send_rows = ws_ + layout_.send_rows;
    char* recv_rows = ws_ + layout_.recv_rows;
    auto* smeta = reinterpret_cast<char*>(send_meta());
    auto* rmeta = reinterpret_cast<char*>(recv_meta());
    {
      nccl_group g;
      for (int p = 0; p < r; ++p) {
        if (sent[p] > 0) {
          send(send_rows + send_off_[p] * rb, sent[p] * rb, p, stream);
          send(smeta + send_off_[p] * mb, sent[p] * mb, p, stream);
        }
        if (got[p] > 0) {
          recv(recv_rows + recv_off_[p] * rb, got[p] * rb, p, stream);
          recv(rmeta + recv_off_[p] * mb, got[p] * mb, p, stream);
        }
      }
      g.end();
    }
    gpu::ep_unpack(recv_meta(), counts() + r, 0, most, k, topo_, local_ids(), local_weights(), stream);
  }

  void dispatch_low_latency(const void* x, const std::int32_t* ids, const float* weights, std::int64_t m,
                            ep_status* status, cudaStream_t stream) {
    const int r = topo_.world_size, k = cfg_.top_k();
    const std::int64_t cap = layout_.slots;
    gpu::ep_send_positions(ids, m, k, topo_, send_pos(), send_token(), layout_.max_tokens, counts(), stream);
    gpu::ep_pack_args a = pack_args(x, ids, weights, m);
    a.fixed_stride = cap;
    a.rows_per_dest = cap;
    a.status = status;
    gpu::ep_pack_rows(a, stream);
    const std::int64_t rows_slot = cap * layout_.row_bytes, meta_slot = cap * layout_.meta_words() * 4;
    char* send_rows = ws_ + layout_.send_rows;
    char* recv_rows = ws_ + layout_.recv_rows;
    auto* smeta = reinterpret_cast<char*>(send_meta());
    auto* rmeta = reinterpret_cast<char*>(recv_meta());
    {
      nccl_group g;
      exchange_counts(stream);
      for (int p = 0; p < r; ++p) {
        send(send_rows + p * rows_slot, rows_slot, p, stream);
        send(smeta + p * meta_slot, meta_slot, p, stream);
        recv(recv_rows + p * rows_slot, rows_slot, p, stream);
        recv(rmeta + p * meta_slot, meta_slot, p, stream);
      }
      g.end();
    }
    gpu::ep_unpack(recv_meta(), counts() + r, cap, cap, k, topo_, local_ids(), local_weights(), stream);
    rows_ = r * cap;
  }

  void dispatch_allgather(const void* x, const std::int32_t* ids, const float* weights, std::int64_t m,
                          cudaStream_t stream) {
    const int r = topo_.world_size, k = cfg_.top_k();
    const std::int64_t mt = layout_.max_tokens, rows_slot = mt * layout_.row_bytes;
    const std::int64_t meta_slot = mt * layout_.meta_words();
    char* rows = ws_ + layout_.recv_rows;
    std::int32_t* meta = recv_meta();
    // Gathered in place: this rank's slot is its send buffer.
    gpu::ep_gather_pack(x, ids, weights, m, k, mt, layout_.row_bytes, rows + topo_.rank * rows_slot,
                        meta + topo_.rank * meta_slot, stream);
    {
      nccl_group g;
      MOE_NCCL_CHECK(ncclAllGather(rows + topo_.rank * rows_slot, rows, static_cast<std::size_t>(rows_slot), ncclUint8,
                                   comm_, stream));
      MOE_NCCL_CHECK(ncclAllGather(meta + topo_.rank * meta_slot, meta, static_cast<std::size_t>(meta_slot), ncclInt32,
                                   comm_, stream));
      g.end();
    }
    gpu::ep_unpack(meta, nullptr, mt, mt, k, topo_, local_ids(), local_weights(), stream);
    rows_ = r * mt;
  }

  ncclComm_t comm_;
  MoeRunnerConfig cfg_;
  dtype type_;
  ep_params params_;
  ep_topology topo_;
  ep_buffer_layout layout_;
  char* ws_ = nullptr;
  std::vector<std::int64_t> host_counts_;  // throughput: [sent to each rank, received from each]
  std::vector<std::int64_t> send_off_, recv_off_;
  const ep_status* checked_status_ = nullptr;  // the last status pointer found to be device memory
  std::int64_t tokens_ = 0;  // M of the last dispatch
  std::int64_t rows_ = 0;    // rows the local runner got in the last dispatch
  bool dispatched_ = false;
};

}  // namespace moerunner

// Expert-parallel dispatch and combine among ranks that share the host's memory (threads of one
// process, one per rank): the reference of the exchange a GPU dispatcher makes over NCCL, with
// the same layouts (dispatch/ep_layout.hpp), for host backends and for checking the GPU ones.
//
//   ep_host_world world(R);                         // shared by the R ranks
//   ep_host_dispatcher disp(world, rank, cfg);      // cfg: num_experts = E, num_local_experts = E/R
//   DispatchOutput d = disp.dispatch(x, topk);      // the rows this rank's experts need
//   CombineInput c = runner.run(d, local_weights, parts, ...);      // parts [d rows, H]
//   disp.combine(c, out);                           // out [M, H]: every rank's part, in rank order
//
// Rows, parts and the output are f32, bf16 or f16 (one dtype); the parts are summed in f32 and
// rounded once.
//
// dispatch and combine are collective: every rank of the world calls them, in the same order.
// The received rows, their routing and the parts stay in the dispatcher between the two calls.
#pragma once

#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moerunner/core/config.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/host_float.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/dispatch/ep_layout.hpp"

namespace moerunner {

// What the ranks exchange through: one mailbox per (source, destination) pair and a barrier.
class ep_host_world {
 public:
  explicit ep_host_world(int size) : size_(size), boxes_(checked(size) * static_cast<std::size_t>(size)), sync_(size) {}
  int size() const { return size_; }

  // All-to-all of byte buffers: send[d] goes to rank d, which finds it in recv[rank].
  void alltoallv(int rank, const std::vector<std::vector<unsigned char>>& send,
                 std::vector<std::vector<unsigned char>>& recv) {
    for (int d = 0; d < size_; ++d) boxes_[rank * size_ + d] = send[d];
    sync_.arrive_and_wait();
    recv.resize(size_);
    for (int s = 0; s < size_; ++s) recv[s] = boxes_[s * size_ + rank];
    sync_.arrive_and_wait();  // nobody writes a mailbox again before every rank has read it
  }

 private:
  static std::size_t checked(int size) {
    MOE_EXPECT(size >= 1, "ep_host_world", "the world needs at least one rank, got " + std::to_string(size));
    return static_cast<std::size_t>(size);
  }
  int size_;
  std::vector<std::vector<unsigned char>> boxes_;
  std::barrier<> sync_;
};

class ep_host_dispatcher {
 public:
  // cfg.num_experts() is the layer's E; cfg.num_local_experts() must be E / world size.
  ep_host_dispatcher(ep_host_world& world, int rank, const MoeRunnerConfig& cfg)
      : world_(world), topo_{world.size(), rank, cfg.num_experts()}, cfg_(cfg) {
    constexpr const char* where = "ep_host_dispatcher";
    topo_.validate(where);
    MOE_EXPECT(cfg.num_local_experts() == topo_.experts_per_rank(), where,
               "num_local_experts must be num_experts / world size = " + std::to_string(topo_.experts_per_rank()) +
                   ", got " + std::to_string(cfg.num_local_experts()));
    MOE_EXPECT(!cfg.no_combine(), where, "expert parallelism combines every token's rows (no_combine is not taken)");
  }

  const ep_topology& topology() const { return topo_; }


  // Sends each token's row ([M, H] on the host) and its slots to the ranks owning its
  // experts; returns the rows this rank received ([rows, H], every source in rank order) with
  // their routing mapped to local ids (-1 where another rank owns the expert).
  DispatchOutput dispatch(const tensor_view& hidden_states, const TopKOutput& topk) {
    constexpr const char* where = "ep_host_dispatcher::dispatch";
    const int k = cfg_.top_k(), h = cfg_.hidden_size(), r = topo_.world_size;
    check::rank(hidden_states, 2, where, "hidden_states");
    check::dim(hidden_states, 1, h, where, "hidden_states");
    const std::int64_t m = hidden_states.shape[0];
    MOE_EXPECT(is_activation_dtype(hidden_states.type), where,
               "hidden_states must be f32, f16 or bf16, got " + std::string(dtype_name(hidden_states.type)));
    check::dense(hidden_states, 2, hidden_states.type, memory_space::host, where, "hidden_states");
    check::dense(topk.topk_ids, 2, dtype::i32, memory_space::host, where, "topk_ids");
    check::dense(topk.topk_weights, 2, dtype::f32, memory_space::host, where, "topk_weights");
    check::dim(topk.topk_ids, 0, m, where, "topk_ids");
    check::dim(topk.topk_ids, 1, k, where, "topk_ids");
    check::dim(topk.topk_weights, 0, m, where, "topk_weights");
    check::dim(topk.topk_weights, 1, k, where, "topk_weights");
    const auto* ids = topk.topk_ids.ptr<const std::int32_t>();
    const auto* wts = topk.topk_weights.ptr<const float>();
    row_bytes_ = static_cast<std::size_t>(h) * dtype_size(hidden_states.type);
    type_ = hidden_states.type;
    tokens_ = m;
    send_ = make_ep_send_layout(ids, m, k, topo_);
    // One message per destination: its rows, then each row's k global ids and k weights.
    const std::size_t entry = row_bytes_ + static_cast<std::size_t>(k) * 8;
    std::vector<std::vector<unsigned char>> out(r), in;
    for (int d = 0; d < r; ++d) {
      out[d].resize(static_cast<std::size_t>(send_.counts[d]) * entry);
      for (std::int64_t i = 0; i < send_.counts[d]; ++i) {
        const std::int64_t tok = send_.token[send_.offsets[d] + i];
        unsigned char* e = out[d].data() + i * entry;
        std::memcpy(e, static_cast<const unsigned char*>(hidden_states.data) + tok * row_bytes_, row_bytes_);
        std::memcpy(e + row_bytes_, ids + tok * k, k * 4);
        std::memcpy(e + row_bytes_ + k * 4, wts + tok * k, k * 4);
      }
    }
    world_.alltoallv(topo_.rank, out, in);
    std::vector<std::int64_t> counts(r);
    for (int s = 0; s < r; ++s) counts[s] = static_cast<std::int64_t>(in[s].size() / entry);
    recv_ = make_ep_recv_layout(counts);
    const std::int64_t rows = recv_.total();
    rows_.assign(static_cast<std::size_t>(rows) * row_bytes_, 0);
    ids_.assign(static_cast<std::size_t>(rows) * k, -1);
    weights_.assign(static_cast<std::size_t>(rows) * k, 0.0f);
    for (int s = 0; s < r; ++s)
      for (std::int64_t i = 0; i < counts[s]; ++i) {
        const unsigned char* e = in[s].data() + i * entry;
        const std::int64_t at = recv_.offsets[s] + i;
        std::memcpy(rows_.data() + at * row_bytes_, e, row_bytes_);
        for (int j = 0; j < k; ++j) {
          std::int32_t id = 0;
          std::memcpy(&id, e + row_bytes_ + j * 4, 4);
          ids_[at * k + j] = topo_.local_on_me(id);
        }
        std::memcpy(weights_.data() + at * k, e + row_bytes_ + k * 4, k * 4);
      }
    const auto host = memory_space::host;
    return {tensor_view::contiguous(rows_.data(), type_, {rows, h}, host),
            {},
            {tensor_view::contiguous(weights_.data(), dtype::f32, {rows, k}, host),
             tensor_view::contiguous(ids_.data(), dtype::i32, {rows, k}, host), topk.routed_scaling_applied}};
  }

  // Returns each received row's part (c: [rows, H] as the local runner combined them, the rows'
  // dtype) to its token's rank and writes out [M, H] (that dtype) = the sum of the parts of every
  // rank, in rank order.
  void combine(const CombineInput& c, const tensor_view& out) {
    constexpr const char* where = "ep_host_dispatcher::combine";
    const int h = cfg_.hidden_size(), r = topo_.world_size;
    MOE_EXPECT(c.combined, where, "the local runner must combine its rows");
    check::dense(c.hidden_states, 2, type_, memory_space::host, where, "parts");
    check::dim(c.hidden_states, 0, recv_.total(), where, "parts");
    check::dim(c.hidden_states, 1, h, where, "parts");
    check::dense(out, 2, type_, memory_space::host, where, "out");
    check::dim(out, 0, tokens_, where, "out");
    check::dim(out, 1, h, where, "out");
    const std::size_t part_bytes = row_bytes_;
    std::vector<std::vector<unsigned char>> back(r), in;
    for (int s = 0; s < r; ++s) {
      const auto* first = static_cast<const unsigned char*>(c.hidden_states.data) + recv_.offsets[s] * part_bytes;
      back[s].assign(first, first + (recv_.offsets[s + 1] - recv_.offsets[s]) * part_bytes);
    }
    world_.alltoallv(topo_.rank, back, in);
    std::vector<float> sum(static_cast<std::size_t>(tokens_) * h, 0.0f);
    for (int d = 0; d < r; ++d) {
      MOE_EXPECT(static_cast<std::int64_t>(in[d].size()) == send_.counts[d] * static_cast<std::int64_t>(part_bytes),
                 where, "rank " + std::to_string(d) + " returned another number of parts than it was sent rows");
      for (std::int64_t i = 0; i < send_.counts[d]; ++i) {
        const std::int64_t tok = send_.token[send_.offsets[d] + i];
        for (int col = 0; col < h; ++col) sum[tok * h + col] += load(in[d].data(), i * h + col);
      }
    }
    for (std::size_t i = 0; i < sum.size(); ++i) store(out.data, static_cast<std::int64_t>(i), sum[i]);
  }

 private:
  float load(const void* p, std::int64_t i) const {
    switch (type_) {
      case dtype::bf16: return host_float::bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
      case dtype::f16: return host_float::half_to_float(static_cast<const std::uint16_t*>(p)[i]);
      default: return static_cast<const float*>(p)[i];
    }
  }
  void store(void* p, std::int64_t i, float v) const {
    switch (type_) {
      case dtype::bf16: static_cast<std::uint16_t*>(p)[i] = host_float::float_to_bf16(v); break;
      case dtype::f16: static_cast<std::uint16_t*>(p)[i] = host_float::float_to_half(v); break;
      default: static_cast<float*>(p)[i] = v;
    }
  }

  ep_host_world& world_;
  ep_topology topo_;
  MoeRunnerConfig cfg_;
  ep_send_layout send_;
  ep_recv_layout recv_;
  dtype type_ = dtype::f32;
  std::int64_t tokens_ = 0;
  std::size_t row_bytes_ = 0;
  std::vector<unsigned char> rows_;
  std::vector<std::int32_t> ids_;
  std::vector<float> weights_;
};

}  // namespace moerunner

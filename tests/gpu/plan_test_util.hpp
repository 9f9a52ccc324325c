// Test helpers for the routing plan: the expected plan computed on the host, and a
// plan built on the device from host ids.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "gpu_test_util.hpp"
#include "moerunner/gpu/permute.cuh"

namespace moerunner::test {

struct expected_plan {
  std::vector<std::int32_t> offsets;      // [E + 1]
  std::vector<std::int32_t> row_to_slot;  // [n], -1 past offsets[E]
  std::vector<std::int32_t> slot_to_row;  // [n]
  bool bad_id = false;
};

// Stable counting sort of the slots by expert; ids outside [-1, E) count as -1 and are reported.
inline expected_plan expect_plan(const std::vector<std::int32_t>& ids, int num_experts) {
  expected_plan p;
  const std::size_t n = ids.size();
  p.offsets.assign(num_experts + 1, 0);
  for (std::int32_t id : ids) {
    if (id >= 0 && id < num_experts) ++p.offsets[id + 1];
    else if (id != -1) p.bad_id = true;
  }
  for (int e = 0; e < num_experts; ++e) p.offsets[e + 1] += p.offsets[e];
  p.row_to_slot.assign(n, -1);
  p.slot_to_row.assign(n, -1);
  std::vector<std::int32_t> cursor(p.offsets.begin(), p.offsets.end() - 1);
  for (std::size_t s = 0; s < n; ++s) {
    const std::int32_t id = ids[s];
    if (id < 0 || id >= num_experts) continue;
    const std::int32_t r = cursor[id]++;
    p.row_to_slot[r] = static_cast<std::int32_t>(s);
    p.slot_to_row[s] = r;
  }
  return p;
}

// topk_ids uploaded and a plan built from them in a poisoned workspace of exactly the queried size.
struct device_plan {
  device_buffer ids;
  device_buffer workspace;
  gpu::routing_plan plan;

  device_plan(const std::vector<std::int32_t>& host_ids, std::int64_t m, int k, int num_experts,
              cudaStream_t stream = nullptr)
      : ids(host_ids.size() * sizeof(std::int32_t)), workspace(gpu::routing_plan_bytes(m, k, num_experts)) {
    ids.upload(host_ids);
    workspace.poison(0x5a);
    plan = gpu::build_routing_plan(ids_view(m, k), num_experts, workspace.get(), workspace.bytes(), stream);
  }

  tensor_view ids_view(std::int64_t m, int k) const {
    return tensor_view::contiguous(ids.get(), dtype::i32, {m, k}, memory_space::device);
  }

  static std::vector<std::int32_t> download(const std::int32_t* p, std::size_t n) {
    std::vector<std::int32_t> h(n);
    if (n) MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    return h;
  }
  std::vector<std::int32_t> offsets() const { return download(plan.expert_offsets, plan.num_experts + 1); }
  std::vector<std::int32_t> row_to_slot() const { return download(plan.row_to_slot, slots()); }
  std::vector<std::int32_t> slot_to_row() const { return download(plan.slot_to_row, slots()); }
  std::size_t slots() const { return static_cast<std::size_t>(plan.num_tokens) * plan.top_k; }
};

// Random ids: distinct experts per token as a router gives them, a fraction of slots filtered (-1).
inline std::vector<std::int32_t> random_ids(std::int64_t m, int k, int num_experts, double filtered,
                                            std::mt19937& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(m) * k);
  std::vector<std::int32_t> perm(num_experts);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (std::int64_t t = 0; t < m; ++t) {
    for (int e = 0; e < num_experts; ++e) perm[e] = e;
    for (int j = 0; j < k; ++j) {
      std::uniform_int_distribution<int> pick(j, num_experts - 1);
      std::swap(perm[j], perm[pick(rng)]);
      ids[t * k + j] = u(rng) < filtered ? -1 : perm[j];
    }
  }
  return ids;
}

}  // namespace moerunner::test

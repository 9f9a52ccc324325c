// The routing kernel against reference::topk (ids and weights bit for bit), the routing
// plan against a host counting sort, the plan built with the M-tile schedule against the
// two built apart and a host tile list, and all captured in a CUDA graph and replayed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "gpu_test_util.hpp"
#include "moerunner/gpu/expert_bands.hpp"
#include "moerunner/gpu/permute.cuh"
#include "moerunner/gpu/plan_schedule.cuh"
#include "moerunner/gpu/routing.cuh"
#include "moerunner/reference/routing.hpp"
#include "plan_test_util.hpp"

namespace mr = moerunner;
using mr::test::device_buffer;
using mr::test::device_tensor;
using mr::test::host_tensor;

namespace {

enum class logit_data { random, ties, nonfinite };

struct routing_case {
  std::int64_t m = 0;
  int e = 0;
  mr::topk_config cfg;
  mr::dtype type = mr::dtype::f32;
  bool bias = false;
  logit_data data = logit_data::random;

  std::string str() const {
    return "M=" + std::to_string(m) + " E=" + std::to_string(e) + " k=" + std::to_string(cfg.top_k) + " " +
           std::string(mr::dtype_name(type)) + (cfg.scoring == mr::scoring_func::softmax ? " softmax" : " sigmoid") +
           (bias ? " bias" : "") + (cfg.renormalize ? " renorm" : "") +
           (cfg.num_expert_group ? " groups=" + std::to_string(cfg.num_expert_group) + "/" +
                                       std::to_string(cfg.topk_group)
                                 : "") +
           (cfg.apply_routed_scaling_factor_on_weights ? " scaled=" + std::to_string(cfg.routed_scaling_factor) : "") +
           (cfg.num_fused_shared_experts ? " shared=" + std::to_string(cfg.num_fused_shared_experts) + "x" +
                                               std::to_string(cfg.fused_shared_expert_weight)
                                         : "") +
           " data=" + std::to_string(static_cast<int>(data));
  }
};

host_tensor make_logits(const routing_case& c, std::mt19937& rng) {
  host_tensor t(c.type, {c.m, c.e});
  mr::test::fill_random(t, rng, 4.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  if (c.data == logit_data::ties)  // multiples of 0.5 in [-4, 4]: 17 values, so many exact ties
    for (std::int64_t i = 0; i < t.numel(); ++i)
      mr::test::set_element(t.view, i, std::round(mr::test::element(t.view, i) * 2.0f) / 2.0f);
  if (c.data == logit_data::nonfinite) {
    std::uniform_int_distribution<int> col(0, c.e - 1);
    for (std::int64_t tok = 0; tok < c.m; ++tok) {
      const std::int64_t row = tok * c.e;
      switch (tok % 8) {
        case 0: for (int n = 0; n < 3; ++n) mr::test::set_element(t.view, row + col(rng), nan); break;
        case 1: for (int i = 0; i < c.e; ++i) mr::test::set_element(t.view, row + i, nan); break;
        case 2: mr::test::set_element(t.view, row + col(rng), inf); break;
        case 3: for (int i = 0; i < c.e; i += 2) mr::test::set_element(t.view, row + i, -inf); break;
        case 4:  // two +inf (or one twice), a -inf and a NaN
          mr::test::set_element(t.view, row + col(rng), inf);
          mr::test::set_element(t.view, row + col(rng), inf);
          mr::test::set_element(t.view, row + col(rng), -inf);
          mr::test::set_element(t.view, row + col(rng), nan);
          break;
        case 5: for (int i = 0; i < c.e; ++i) mr::test::set_element(t.view, row + i, -inf); break;
        case 6:  // no finite logit: -inf and NaN
          for (int i = 0; i < c.e; ++i) mr::test::set_element(t.view, row + i, i % 3 == 0 ? nan : -inf);
          break;
        default: break;  // finite row between the others
      }
    }
  }
  return t;
}

host_tensor make_bias(const routing_case& c, std::mt19937& rng) {
  host_tensor b(mr::dtype::f32, {c.e});
  mr::test::fill_random(b, rng, 0.5f);
  if (c.data == logit_data::ties)
    for (int i = 0; i < c.e; ++i) b.view.ptr<float>()[i] = std::round(b.view.ptr<float>()[i] * 4.0f) / 4.0f;
  return b;
}

bool same_weight(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

// Device topk on fresh data, outputs poisoned first, against reference::topk bit for bit; every
// weight finite.
void check_routing(const routing_case& c, std::mt19937& rng) {
  CAPTURE(c.str());
  const int k = mr::reference::topk_slots(c.cfg);
  host_tensor logits = make_logits(c, rng);
  host_tensor bias = make_bias(c, rng);
  host_tensor ref_w(mr::dtype::f32, {c.m, k}), ref_ids(mr::dtype::i32, {c.m, k});
  mr::TopKOutput ref{ref_w.view, ref_ids.view};
  mr::reference::topk(logits.view, c.bias ? &bias.view : nullptr, c.cfg, ref);

  device_tensor d_logits(logits), d_bias(bias);
  device_buffer w_buf(ref_w.view.bytes()), id_buf(ref_ids.view.bytes());
  w_buf.poison(0x5a);
  id_buf.poison(0x5a);
  mr::TopKOutput out{mr::tensor_view::contiguous(w_buf.get(), mr::dtype::f32, {c.m, k}, mr::memory_space::device),
                     mr::tensor_view::contiguous(id_buf.get(), mr::dtype::i32, {c.m, k}, mr::memory_space::device)};
  mr::gpu::topk(d_logits.view, c.bias ? &d_bias.view : nullptr, c.cfg, out, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(out.routed_scaling_applied == ref.routed_scaling_applied);

  const auto w = w_buf.download<float>(static_cast<std::size_t>(c.m) * k);
  const auto ids = id_buf.download<std::int32_t>(static_cast<std::size_t>(c.m) * k);
  int mismatches = 0, non_finite = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    non_finite += std::isfinite(w[i]) ? 0 : 1;
    const float rw = ref_w.view.ptr<float>()[i];
    const std::int32_t rid = ref_ids.view.ptr<std::int32_t>()[i];
    if (ids[i] == rid && same_weight(w[i], rw)) continue;
    if (++mismatches <= 5)
      MESSAGE("token " << i / k << " slot " << i % k << ": gpu (" << ids[i] << ", " << w[i] << ") reference (" << rid
                       << ", " << rw << ")");
  }
  CHECK(mismatches == 0);
  CHECK(non_finite == 0);
}

constexpr mr::dtype logit_types[] = {mr::dtype::f32, mr::dtype::bf16, mr::dtype::f16};

}  // namespace

TEST_CASE("topk: ids and weights are bit-identical to the reference over E, k, M, scoring and data") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  int n = 0;
  for (int e : {8, 60, 128, 256, 512})
    for (int k : {1, 2, 6, 8, 16}) {
      if (k > e) continue;
      for (std::int64_t m : {0, 1, 7, 1000})
        for (auto scoring : {mr::scoring_func::softmax, mr::scoring_func::sigmoid}) {
          routing_case c;
          c.m = m;
          c.e = e;
          c.cfg.top_k = k;
          c.cfg.scoring = scoring;
          c.bias = (n / 2) % 2 == 1;
          c.cfg.renormalize = (n / 4) % 2 == 0;
          c.cfg.apply_routed_scaling_factor_on_weights = n % 3 == 0;
          c.cfg.routed_scaling_factor = c.cfg.apply_routed_scaling_factor_on_weights ? 2.5f : 1.0f;
          c.type = logit_types[n % 3];
          c.data = static_cast<logit_data>((n / 3) % 3);
          ++n;
          check_routing(c, rng);
        }
    }
}

TEST_CASE("topk: grouped selection (DeepSeek-V3 and other group shapes) matches the reference bit for bit") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct group_shape {
    int e, groups, keep, k;
    mr::scoring_func scoring;
    bool bias;
  };
  const group_shape shapes[] = {
      {256, 8, 4, 8, mr::scoring_func::sigmoid, true},    // DeepSeek-V3
      {256, 8, 4, 8, mr::scoring_func::softmax, false},
      {128, 4, 2, 8, mr::scoring_func::softmax, false},
      {60, 3, 1, 6, mr::scoring_func::sigmoid, true},     // 3 groups of 20: 8 lanes per group
      {60, 20, 5, 8, mr::scoring_func::softmax, true},    // 20 groups of 3: one lane per group
      {60, 30, 4, 8, mr::scoring_func::sigmoid, true},    // groups of 2
      {8, 8, 3, 2, mr::scoring_func::sigmoid, true},      // groups of 1: the bias sum has no second key
      {8, 2, 1, 2, mr::scoring_func::softmax, true},
      {512, 32, 4, 16, mr::scoring_func::sigmoid, true},  // 32 groups of 16
      {512, 2, 1, 16, mr::scoring_func::softmax, false},  // one lane group of 16 scanning 256 experts
      {512, 16, 16, 8, mr::scoring_func::sigmoid, true},  // every group kept
  };
  int n = 0;
  for (const auto& s : shapes)
    for (std::int64_t m : {1, 7, 1000})
      for (logit_data data : {logit_data::random, logit_data::ties, logit_data::nonfinite}) {
        routing_case c;
        c.m = m;
        c.e = s.e;
        c.cfg.top_k = s.k;
        c.cfg.scoring = s.scoring;
        c.cfg.num_expert_group = s.groups;
        c.cfg.topk_group = s.keep;
        c.cfg.renormalize = n % 4 != 3;
        c.cfg.apply_routed_scaling_factor_on_weights = n % 2 == 0;
        c.cfg.routed_scaling_factor = 2.5f;
        c.bias = s.bias;
        c.type = logit_types[n % 3];
        c.data = data;
        ++n;
        check_routing(c, rng);
      }
}

TEST_CASE("topk: non-finite logits route like the reference bit for bit, with every option") {
  // NaN, +inf (one and two), -inf, and rows with no finite logit (routing/topk_rules.hpp), with
  // softmax and sigmoid, bias, grouped top-k, renormalization, routed scaling and shared experts.
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct shape {
    int e, k, groups, keep;
  };
  int n = 0;
  for (const shape& sh : {shape{16, 4, 0, 0}, shape{16, 4, 4, 2}, shape{60, 6, 3, 1}, shape{256, 8, 8, 4},
                          shape{512, 16, 0, 0}})
    for (auto scoring : {mr::scoring_func::softmax, mr::scoring_func::sigmoid})
      for (bool bias : {false, true})
        for (bool renorm : {false, true})
          for (bool scaled : {false, true}) {
            routing_case c;
            c.m = 40;  // five of each kind of row
            c.e = sh.e;
            c.cfg = {.top_k = sh.k, .scoring = scoring, .renormalize = renorm, .num_expert_group = sh.groups,
                     .topk_group = sh.keep, .routed_scaling_factor = 2.5f,
                     .apply_routed_scaling_factor_on_weights = scaled, .num_fused_shared_experts = n % 3 == 0 ? 1 : 0};
            c.bias = bias;
            c.type = logit_types[n % 3];
            c.data = logit_data::nonfinite;
            ++n;
            check_routing(c, rng);
          }
}

TEST_CASE("topk: fused shared experts match the reference bit for bit, with grouped top-k and routed scaling") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct shared_case {
    int e, k, groups, keep;
    mr::scoring_func scoring;
    bool bias;
    int shared;
    float weight;
  };
  const shared_case cases[] = {
      {256, 8, 8, 4, mr::scoring_func::sigmoid, true, 1, 1.0f},   // DeepSeek-V3 with its shared expert fused
      {160, 6, 8, 3, mr::scoring_func::softmax, false, 2, 1.0f},  // two shared experts (DeepSeek-V2 style)
      {128, 8, 0, 0, mr::scoring_func::softmax, false, 1, 0.5f},
      {60, 4, 0, 0, mr::scoring_func::softmax, false, 4, 1.0f},
      {512, 16, 0, 0, mr::scoring_func::sigmoid, true, mr::max_top_k - 16, 2.0f},  // every slot the runner takes
  };
  int n = 0;
  for (const shared_case& sc : cases)
    for (std::int64_t m : {1, 7, 1000})
      for (bool scaled : {false, true}) {
        routing_case c;
        c.m = m;
        c.e = sc.e;
        c.cfg = {.top_k = sc.k, .scoring = sc.scoring, .renormalize = n % 4 != 3, .num_expert_group = sc.groups,
                 .topk_group = sc.keep, .routed_scaling_factor = 2.5f, .apply_routed_scaling_factor_on_weights = scaled,
                 .num_fused_shared_experts = sc.shared, .fused_shared_expert_weight = sc.weight};
        c.bias = sc.bias;
        c.type = logit_types[n % 3];
        c.data = static_cast<logit_data>(n % 3);
        ++n;
        check_routing(c, rng);
      }
}

TEST_CASE("topk: M = 0 launches nothing and still reports the scaling") {
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  mr::topk_config cfg{.top_k = 2, .apply_routed_scaling_factor_on_weights = true};
  const auto logits = mr::tensor_view::contiguous(nullptr, mr::dtype::bf16, {0, 8}, mr::memory_space::device);
  mr::TopKOutput out{mr::tensor_view::contiguous(nullptr, mr::dtype::f32, {0, 2}, mr::memory_space::device),
                     mr::tensor_view::contiguous(nullptr, mr::dtype::i32, {0, 2}, mr::memory_space::device)};
  cudaGraph_t graph;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  mr::gpu::topk(logits, nullptr, cfg, out, stream);
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  std::size_t nodes = 99;
  MOE_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  CHECK(nodes == 0);
  CHECK(out.routed_scaling_applied);
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("topk: bad arguments throw and write nothing") {
  std::mt19937 rng(7);
  host_tensor logits(mr::dtype::f32, {4, 16});
  mr::test::fill_random(logits, rng);
  device_tensor d_logits(logits);
  device_buffer w_buf(4 * 4 * 4), id_buf(4 * 4 * 4);
  w_buf.poison(0x5a);
  id_buf.poison(0x5a);
  auto out_for = [&](int k) {
    return mr::TopKOutput{
        mr::tensor_view::contiguous(w_buf.get(), mr::dtype::f32, {4, k}, mr::memory_space::device),
        mr::tensor_view::contiguous(id_buf.get(), mr::dtype::i32, {4, k}, mr::memory_space::device)};
  };
  mr::TopKOutput out = out_for(4);
  CHECK_THROWS_AS(mr::gpu::topk(logits.view, nullptr, {.top_k = 4}, out, nullptr), mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::topk(d_logits.view, nullptr, {.top_k = 0}, out, nullptr), mr::invalid_argument_error);
  mr::TopKOutput wrong_k = out_for(3);
  CHECK_THROWS_AS(mr::gpu::topk(d_logits.view, nullptr, {.top_k = 4}, wrong_k, nullptr), mr::invalid_argument_error);
  // Outputs without room for the shared experts' slots.
  CHECK_THROWS_AS(mr::gpu::topk(d_logits.view, nullptr, {.top_k = 4, .num_fused_shared_experts = 1}, out, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::topk(d_logits.view, nullptr, {.top_k = 3, .num_fused_shared_experts = -1}, wrong_k,
                                nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::topk(d_logits.view, nullptr, {.top_k = 4, .num_expert_group = 3, .topk_group = 1}, out,
                                nullptr),
                  mr::invalid_argument_error);
  host_tensor wide(mr::dtype::f32, {1, 513});
  mr::test::fill_random(wide, rng);
  device_tensor d_wide(wide);
  CHECK_THROWS_AS(mr::gpu::topk(d_wide.view, nullptr, {.top_k = 4}, out, nullptr), mr::invalid_argument_error);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (unsigned char b : w_buf.download<unsigned char>(w_buf.bytes())) REQUIRE(b == 0x5a);
  for (unsigned char b : id_buf.download<unsigned char>(id_buf.bytes())) REQUIRE(b == 0x5a);
}

namespace {

void check_plan(const mr::test::device_plan& d, const std::vector<std::int32_t>& ids, int num_experts) {
  const mr::test::expected_plan want = mr::test::expect_plan(ids, num_experts);
  CHECK(d.offsets() == want.offsets);
  CHECK(d.row_to_slot() == want.row_to_slot);
  CHECK(d.slot_to_row() == want.slot_to_row);
  CHECK(mr::gpu::read_plan_error(d.plan, nullptr) == (want.bad_id ? 1 : 0));
}

enum class id_pattern { random, filtered, one_expert, two_experts, bad_ids };

std::vector<std::int32_t> make_ids(std::int64_t m, int k, int num_experts, id_pattern p, std::mt19937& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(m) * k);
  std::uniform_int_distribution<int> expert(0, num_experts - 1);
  std::uniform_int_distribution<int> pct(0, 99);
  for (auto& id : ids) {
    switch (p) {
      case id_pattern::random: id = expert(rng); break;
      case id_pattern::filtered: id = pct(rng) < 20 ? -1 : expert(rng); break;
      case id_pattern::one_expert: id = num_experts - 1; break;
      case id_pattern::two_experts: id = pct(rng) < 50 ? num_experts / 3 : num_experts - 1; break;
      case id_pattern::bad_ids: {
        const int r = pct(rng);
        id = r < 3 ? num_experts : r < 5 ? -2 : r < 6 ? (1 << 30) : r < 15 ? -1 : expert(rng);
        break;
      }
    }
  }
  return ids;
}

constexpr id_pattern every_id_pattern[] = {id_pattern::random, id_pattern::filtered, id_pattern::one_expert,
                                           id_pattern::two_experts, id_pattern::bad_ids};

struct size_case {
  std::int64_t m;
  int k, e;
};

// Slots straddle every plan kernel variant: exactly 256, 1024 and 4096 (one block) and tiles
// of 1024 above; E covers 1 to plan_max_experts, k 1 to 16. All on one expert, 131072 rows
// make 2048 M tiles of 64, more than the scan kernel has threads.
constexpr size_case plan_sizes[] = {
    {0, 2, 8},      {0, 1, 1},       {1, 1, 1},       {1, 8, 256},      {1, 2, 1024},     {7, 2, 8},
    {7, 8, 1024},   {7, 1, 1},       {128, 2, 8},     {128, 2, 60},     {129, 2, 60},     {256, 1, 256},
    {32, 8, 1024},  {512, 2, 8},     {512, 2, 128},   {128, 8, 256},    {1024, 1, 1024},  {1000, 1, 8},
    {64, 16, 512},  {513, 8, 256},   {4096, 1, 1},    {2048, 2, 256},   {512, 8, 1024},   {4097, 1, 3},
    {4097, 1, 8},   {4097, 1, 1024}, {1000, 6, 60},   {3000, 8, 512},   {5000, 8, 256},   {20000, 2, 1024},
    {40000, 1, 1},  {16384, 8, 8},   {16384, 8, 256}, {16384, 8, 1024}};

// Calls check(ids, size) on fresh ids of every pattern for every size.
template <class F>
void for_each_plan_input(std::span<const size_case> sizes, F&& check) {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (const auto& s : sizes)
    for (id_pattern p : every_id_pattern) {
      CAPTURE(s.m);
      CAPTURE(s.k);
      CAPTURE(s.e);
      CAPTURE(static_cast<int>(p));
      check(make_ids(s.m, s.k, s.e, p, rng), s);
    }
}

}  // namespace

TEST_CASE("routing plan: counts, offsets, stable order and inverse match a host counting sort") {
  for_each_plan_input(plan_sizes, [](const std::vector<std::int32_t>& ids, const size_case& s) {
    mr::test::device_plan d(ids, s.m, s.k, s.e);
    check_plan(d, ids, s.e);
  });
}

TEST_CASE("routing plan: the build clears the error flag a bad batch set") {
  std::mt19937 rng(11);
  for (std::int64_t m : {100, 2000}) {  // one block, then tiles
    const int k = 4, e = 16;
    auto ids = make_ids(m, k, e, id_pattern::random, rng);
    ids[ids.size() / 2] = e;
    mr::test::device_plan d(ids, m, k, e);
    CHECK(mr::gpu::read_plan_error(d.plan, nullptr) == 1);
    ids[ids.size() / 2] = -1;
    d.ids.upload(ids);
    d.plan = mr::gpu::build_routing_plan(d.ids_view(m, k), e, d.workspace.get(), d.workspace.bytes(), nullptr);
    check_plan(d, ids, e);
  }
}

TEST_CASE("routing plan: bad arguments throw and write nothing") {
  const int e = 8;
  const std::int64_t m = 4;
  const int k = 2;
  device_buffer ids(m * k * 4), ws(mr::gpu::routing_plan_bytes(m, k, e) + 256);
  ids.poison(0);
  ws.poison(0x5a);
  const auto view = mr::tensor_view::contiguous(ids.get(), mr::dtype::i32, {m, k}, mr::memory_space::device);
  const std::size_t need = mr::gpu::routing_plan_bytes(m, k, e);
  auto build = [&](const mr::tensor_view& v, int experts, void* w, std::size_t bytes) {
    return mr::gpu::build_routing_plan(v, experts, w, bytes, nullptr);
  };
  auto f32_view = view;
  f32_view.type = mr::dtype::f32;
  auto host_view = view;
  host_view.space = mr::memory_space::host;
  const auto flat = mr::tensor_view::contiguous(ids.get(), mr::dtype::i32, {m * k}, mr::memory_space::device);
  CHECK_THROWS_AS(build(f32_view, e, ws.get(), need), mr::invalid_argument_error);
  CHECK_THROWS_AS(build(host_view, e, ws.get(), need), mr::invalid_argument_error);
  CHECK_THROWS_AS(build(flat, e, ws.get(), need), mr::invalid_argument_error);
  CHECK_THROWS_AS(build(view, 0, ws.get(), need), mr::invalid_argument_error);
  CHECK_THROWS_AS(build(view, mr::gpu::plan_max_experts + 1, ws.get(), ws.bytes()), mr::invalid_argument_error);
  CHECK_THROWS_AS(build(view, e, ws.get(), need - 1), mr::invalid_argument_error);
  CHECK_THROWS_AS(build(view, e, static_cast<char*>(ws.get()) + 4, need), mr::invalid_argument_error);
  CHECK_THROWS_AS(build(view, e, nullptr, need), mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::routing_plan_bytes(-1, k, e), mr::invalid_argument_error);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (unsigned char b : ws.download<unsigned char>(ws.bytes())) REQUIRE(b == 0x5a);
}

TEST_CASE("routing plan: bad ids are added to the caller's status word, one block and tiled") {
  // 400 slots (one block), 8000 (tiles of 1024, the bad ids in some tiles only) and 40000.
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (const size_case& s : {size_case{100, 4, 16}, size_case{2000, 4, 16}, size_case{5000, 8, 256}}) {
    CAPTURE(s.m);
    const auto n = static_cast<std::size_t>(s.m) * s.k;
    const std::vector<std::int32_t> good = make_ids(s.m, s.k, s.e, id_pattern::filtered, rng);
    std::vector<std::int32_t> bad = good;
    const std::size_t at[] = {n - 1, n / 2 + 3, n / 3, n / 3 + 1};  // the lowest is n / 3
    const std::int32_t values[] = {s.e, -2, 1 << 30, -1000};
    for (int i = 0; i < 4; ++i) bad[at[i]] = values[i];
    const int want_first = static_cast<int>(n / 3);
    mr::test::device_plan d(good, s.m, s.k, s.e);
    mr::test::device_status status;
    auto build = [&](const std::vector<std::int32_t>& ids, mr::moe_status* st) {
      d.ids.upload(ids);
      d.plan = mr::gpu::build_routing_plan(d.ids_view(s.m, s.k), s.e, d.workspace.get(), d.workspace.bytes(), nullptr,
                                           st);
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
    };
    build(good, status.get());
    CHECK(status.read().bad_slots == 0);
    CHECK(status.read().first_bad_slot == 0);
    build(bad, status.get());
    check_plan(d, bad, s.e);  // the plan itself as without a status
    CHECK(status.read().bad_slots == 4);
    CHECK(status.read().first_bad_slot == want_first);
    // A second bad build adds its count; the first bad slot stays the first build's.
    std::vector<std::int32_t> earlier = good;
    earlier[0] = s.e;
    build(earlier, status.get());
    CHECK(status.read().bad_slots == 5);
    CHECK(status.read().first_bad_slot == want_first);
    build(bad, nullptr);  // no status: nothing is added
    CHECK(status.read().bad_slots == 5);
    // Saturation instead of wrapping.
    const mr::moe_status nearly_full{.bad_slots = 0x7fffffff - 2, .first_bad_slot = 9};
    MOE_CUDA_CHECK(cudaMemcpy(status.get(), &nearly_full, sizeof nearly_full, cudaMemcpyHostToDevice));
    build(bad, status.get());
    CHECK(status.read().bad_slots == 0x7fffffff);
    CHECK(status.read().first_bad_slot == 9);
  }
}

namespace {

// run() captured once on `stream` and instantiated, to be replayed.
class captured_run {
 public:
  template <class Run>
  captured_run(cudaStream_t stream, Run&& run) : stream_(stream) {
    MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    run();
    MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  captured_run(const captured_run&) = delete;
  captured_run& operator=(const captured_run&) = delete;
  ~captured_run() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }

  void replay() const { MOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }

  // Checks that three replays, each after poison(), give the bits snapshot() took of a direct run.
  template <class Poison, class Snapshot>
  void check_replays(Poison&& poison, Snapshot&& snapshot, const std::vector<unsigned char>& direct) const {
    for (int n = 0; n < 3; ++n) {
      poison();
      replay();
      CHECK(snapshot() == direct);
    }
  }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace

TEST_CASE("topk and routing plan captured in a CUDA graph replay to the same bits") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct graph_case {
    std::int64_t m;
    int e, k, groups, keep;
    mr::scoring_func scoring;
    bool bias;
  };
  const graph_case cases[] = {{7, 256, 8, 8, 4, mr::scoring_func::sigmoid, true},
                              {1000, 128, 8, 0, 0, mr::scoring_func::softmax, false},
                              {600, 64, 8, 0, 0, mr::scoring_func::softmax, true}};  // 4800 slots: tiled plan
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const auto& g : cases) {
    CAPTURE(g.m);
    routing_case c;
    c.m = g.m;
    c.e = g.e;
    c.cfg = {.top_k = g.k, .scoring = g.scoring, .num_expert_group = g.groups, .topk_group = g.keep};
    c.type = mr::dtype::bf16;
    c.bias = g.bias;
    host_tensor logits = make_logits(c, rng);
    host_tensor bias = make_bias(c, rng);
    device_tensor d_logits(logits), d_bias(bias);
    const std::size_t slots = static_cast<std::size_t>(g.m) * g.k;
    device_buffer w_buf(slots * 4), id_buf(slots * 4), ws(mr::gpu::routing_plan_bytes(g.m, g.k, g.e));
    mr::TopKOutput out{
        mr::tensor_view::contiguous(w_buf.get(), mr::dtype::f32, {g.m, g.k}, mr::memory_space::device),
        mr::tensor_view::contiguous(id_buf.get(), mr::dtype::i32, {g.m, g.k}, mr::memory_space::device)};
    mr::gpu::routing_plan plan;
    auto run = [&] {
      mr::gpu::topk(d_logits.view, g.bias ? &d_bias.view : nullptr, c.cfg, out, stream);
      plan = mr::gpu::build_routing_plan(out.topk_ids, g.e, ws.get(), ws.bytes(), stream);
    };
    auto snapshot = [&] {
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<unsigned char> all = w_buf.download<unsigned char>(w_buf.bytes());
      const auto ids = id_buf.download<unsigned char>(id_buf.bytes());
      const auto plan_bytes = ws.download<unsigned char>(ws.bytes());
      all.insert(all.end(), ids.begin(), ids.end());
      all.insert(all.end(), plan_bytes.begin(), plan_bytes.end());
      return all;
    };
    auto poison = [&] {
      w_buf.poison(0x5a);
      id_buf.poison(0x5a);
      ws.poison(0x5a);
    };

    poison();
    run();
    const auto direct = snapshot();
    const captured_run graph(stream, run);
    graph.check_replays(poison, snapshot, direct);

    // New logits in the same buffers: the replay routes them like the reference does.
    host_tensor fresh = make_logits(c, rng);
    MOE_CUDA_CHECK(cudaMemcpy(d_logits.view.data, fresh.view.data, fresh.view.bytes(), cudaMemcpyHostToDevice));
    poison();
    graph.replay();
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    host_tensor ref_w(mr::dtype::f32, {g.m, g.k}), ref_ids(mr::dtype::i32, {g.m, g.k});
    mr::TopKOutput ref{ref_w.view, ref_ids.view};
    mr::reference::topk(fresh.view, g.bias ? &bias.view : nullptr, c.cfg, ref);
    const auto ids = id_buf.download<std::int32_t>(slots);
    const auto w = w_buf.download<float>(slots);
    const std::vector<std::int32_t> want_ids(ref_ids.view.ptr<std::int32_t>(), ref_ids.view.ptr<std::int32_t>() + slots);
    CHECK(ids == want_ids);
    for (std::size_t i = 0; i < slots; ++i) REQUIRE(same_weight(w[i], ref_w.view.ptr<float>()[i]));
    const mr::test::expected_plan want = mr::test::expect_plan(want_ids, g.e);
    CHECK(mr::test::device_plan::download(plan.expert_offsets, g.e + 1) == want.offsets);
    CHECK(mr::test::device_plan::download(plan.row_to_slot, slots) == want.row_to_slot);
    CHECK(mr::test::device_plan::download(plan.slot_to_row, slots) == want.slot_to_row);
    CHECK(mr::gpu::read_plan_error(plan, stream) == 0);
  }
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

namespace {

// The M-tile schedule of a plan with these expert offsets, written out on the host: the tiles
// of expert e follow those of the experts before it, each block_m rows but the last; with
// expert_band > 0 each carries its band word (gpu/expert_bands.hpp).
std::vector<mr::gpu::moe_m_tile> expect_tiles(const std::vector<std::int32_t>& offsets, int block_m,
                                              int expert_band = 0) {
  std::vector<mr::gpu::moe_m_tile> tiles;
  std::vector<int> first(1, 0);  // each expert's first tile, then the total
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e) {
    for (std::int32_t begin = offsets[e]; begin < offsets[e + 1]; begin += block_m)
      tiles.push_back({static_cast<std::int32_t>(e), begin, std::min(begin + block_m, offsets[e + 1]), 0});
    first.push_back(static_cast<int>(tiles.size()));
  }
  if (expert_band > 0)
    for (std::size_t i = 0; i < tiles.size(); ++i) {
      const auto e = static_cast<std::size_t>(tiles[i].expert);
      tiles[i].band = mr::gpu::expert_band_word(static_cast<int>(i), first[e], first[e + 1] - first[e],
                                                static_cast<int>(tiles.size()), expert_band);
    }
  return tiles;
}

std::vector<unsigned char> download_bytes(const void* p, std::size_t n) {
  std::vector<unsigned char> h(n);
  if (n) MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
  return h;
}

std::vector<mr::gpu::moe_m_tile> download_tiles(const mr::gpu::moe_m_tile* p, std::size_t n) {
  std::vector<mr::gpu::moe_m_tile> h(n);
  if (n) MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(mr::gpu::moe_m_tile), cudaMemcpyDeviceToHost));
  return h;
}

bool same_tile(const mr::gpu::moe_m_tile& a, const mr::gpu::moe_m_tile& b) {
  return a.expert == b.expert && a.row_begin == b.row_begin && a.row_end == b.row_end && a.band == b.band;
}

std::ptrdiff_t byte_offset(const void* p, const void* base) {
  return static_cast<const char*>(p) - static_cast<const char*>(base);
}

// Checks the fused build's plan and schedule against the host: the plan of expect_plan, the
// tiles of expect_tiles, the tile count, and the tiles past the count left as poisoned.
void check_plan_and_schedule_against_host(const mr::gpu::plan_and_schedule& got, const std::vector<std::int32_t>& ids,
                                          int num_experts, int block_m, int expert_band = 0) {
  const mr::test::expected_plan want = mr::test::expect_plan(ids, num_experts);
  const std::size_t slots = ids.size();
  CHECK(mr::test::device_plan::download(got.plan.expert_offsets, num_experts + 1) == want.offsets);
  CHECK(mr::test::device_plan::download(got.plan.row_to_slot, slots) == want.row_to_slot);
  CHECK(mr::test::device_plan::download(got.plan.slot_to_row, slots) == want.slot_to_row);
  CHECK(mr::test::device_plan::download(got.plan.error_flag, 1)[0] == (want.bad_id ? 1 : 0));

  const std::vector<mr::gpu::moe_m_tile> want_tiles = expect_tiles(want.offsets, block_m, expert_band);
  const std::int32_t count = mr::test::device_plan::download(got.schedule.count, 1)[0];
  REQUIRE(count == static_cast<std::int32_t>(want_tiles.size()));
  REQUIRE(got.schedule.capacity >= count);
  const auto tiles = download_tiles(got.schedule.tiles, static_cast<std::size_t>(got.schedule.capacity));
  int mismatches = 0;
  for (std::size_t i = 0; i < want_tiles.size(); ++i) {
    if (same_tile(tiles[i], want_tiles[i])) continue;
    if (++mismatches <= 5)
      MESSAGE("tile " << i << ": got {" << tiles[i].expert << ", " << tiles[i].row_begin << ", " << tiles[i].row_end
                      << ", " << tiles[i].band << "} want {" << want_tiles[i].expert << ", "
                      << want_tiles[i].row_begin << ", " << want_tiles[i].row_end << ", " << want_tiles[i].band
                      << "}");
  }
  CHECK(mismatches == 0);
  const auto tail = download_bytes(got.schedule.tiles + count,
                                   static_cast<std::size_t>(got.schedule.capacity - count) * sizeof(mr::gpu::moe_m_tile));
  for (unsigned char b : tail) REQUIRE(b == 0xff);
}

// Builds the plan and schedule apart (build_routing_plan + build_tile_schedule) and together
// (build_routing_plan_and_schedule) on the same ids, each in workspaces poisoned with 0xff,
// and checks that both carve the same pieces and write the same bits, and the fused build
// against the host.
void check_fused_build(const std::vector<std::int32_t>& ids, std::int64_t m, int k, int num_experts, int block_m,
                       int expert_band = 0) {
  const std::int64_t rows = m * k;
  device_buffer d_ids(ids.size() * sizeof(std::int32_t));
  d_ids.upload(ids);
  const auto view = mr::tensor_view::contiguous(d_ids.get(), mr::dtype::i32, {m, k}, mr::memory_space::device);
  const std::size_t plan_bytes = mr::gpu::routing_plan_bytes(m, k, num_experts);
  const std::size_t schedule_bytes = mr::gpu::tile_schedule_bytes(rows, num_experts, block_m);
  device_buffer apart_plan(plan_bytes), apart_schedule(schedule_bytes), fused_plan(plan_bytes),
      fused_schedule(schedule_bytes);
  apart_plan.poison(0xff);
  apart_schedule.poison(0xff);
  fused_plan.poison(0xff);
  fused_schedule.poison(0xff);

  const mr::gpu::routing_plan plan = mr::gpu::build_routing_plan(view, num_experts, apart_plan.get(), plan_bytes, nullptr);
  const mr::gpu::tile_schedule schedule =
      mr::gpu::build_tile_schedule(plan, rows, block_m, apart_schedule.get(), schedule_bytes, nullptr, expert_band);
  const mr::gpu::plan_and_schedule fused =
      mr::gpu::build_routing_plan_and_schedule(view, num_experts, block_m, fused_plan.get(), plan_bytes,
                                               fused_schedule.get(), schedule_bytes, nullptr, false, nullptr, expert_band);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());

  // The same pieces of the same workspaces.
  CHECK(fused.plan.num_experts == plan.num_experts);
  CHECK(fused.plan.top_k == plan.top_k);
  CHECK(fused.plan.num_tokens == plan.num_tokens);
  CHECK(byte_offset(fused.plan.expert_offsets, fused_plan.get()) == byte_offset(plan.expert_offsets, apart_plan.get()));
  CHECK(byte_offset(fused.plan.row_to_slot, fused_plan.get()) == byte_offset(plan.row_to_slot, apart_plan.get()));
  CHECK(byte_offset(fused.plan.slot_to_row, fused_plan.get()) == byte_offset(plan.slot_to_row, apart_plan.get()));
  CHECK(byte_offset(fused.plan.error_flag, fused_plan.get()) == byte_offset(plan.error_flag, apart_plan.get()));
  CHECK(byte_offset(fused.schedule.count, fused_schedule.get()) == byte_offset(schedule.count, apart_schedule.get()));
  CHECK(byte_offset(fused.schedule.tiles, fused_schedule.get()) == byte_offset(schedule.tiles, apart_schedule.get()));
  CHECK(fused.schedule.capacity == schedule.capacity);
  CHECK(fused.schedule.capacity == mr::gpu::moe_m_tile_capacity(rows, num_experts, block_m));
  CHECK(fused.schedule.block_m == block_m);
  CHECK(schedule.block_m == block_m);
  CHECK(fused.schedule.expert_band == expert_band);
  CHECK(schedule.expert_band == expert_band);

  // The same bits, array by array, then every byte of both workspaces (scratch and the
  // unused tiles included).
  const auto slots = static_cast<std::size_t>(rows);
  using mr::test::device_plan;
  CHECK(device_plan::download(fused.plan.expert_offsets, num_experts + 1) ==
        device_plan::download(plan.expert_offsets, num_experts + 1));
  CHECK(device_plan::download(fused.plan.row_to_slot, slots) == device_plan::download(plan.row_to_slot, slots));
  CHECK(device_plan::download(fused.plan.slot_to_row, slots) == device_plan::download(plan.slot_to_row, slots));
  CHECK(device_plan::download(fused.plan.error_flag, 1) == device_plan::download(plan.error_flag, 1));
  CHECK(device_plan::download(fused.schedule.count, 1) == device_plan::download(schedule.count, 1));
  const std::size_t tile_bytes = static_cast<std::size_t>(schedule.capacity) * sizeof(mr::gpu::moe_m_tile);
  CHECK(download_bytes(fused.schedule.tiles, tile_bytes) == download_bytes(schedule.tiles, tile_bytes));
  CHECK(fused_plan.download<unsigned char>(plan_bytes) == apart_plan.download<unsigned char>(plan_bytes));
  CHECK(fused_schedule.download<unsigned char>(schedule_bytes) == apart_schedule.download<unsigned char>(schedule_bytes));

  check_plan_and_schedule_against_host(fused, ids, num_experts, block_m, expert_band);
}

// What a call did while `stream` was captured: whether it threw invalid_argument_error (and
// what it said), and how many graph nodes it added.
struct capture_result {
  bool threw = false;
  std::string message;
  std::size_t nodes = 0;
};

template <class F>
capture_result capture_call(cudaStream_t stream, F&& call) {
  capture_result r;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    call();
  } catch (const mr::invalid_argument_error& e) {
    r.threw = true;
    r.message = e.what();
  } catch (...) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  cudaGraph_t graph;
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOE_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &r.nodes));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  return r;
}

}  // namespace

TEST_CASE("routing plan with schedule: bit-identical to the plan and schedule built apart, and to a host tile list") {
  for_each_plan_input(plan_sizes, [](const std::vector<std::int32_t>& ids, const size_case& s) {
    for (int block_m : {128, 64}) {
      CAPTURE(block_m);
      check_fused_build(ids, s.m, s.k, s.e, block_m);
      // With band words for expert bands of 1, 3 and 8 tiles.
      for (int band : {1, 3, 8}) {
        CAPTURE(band);
        check_fused_build(ids, s.m, s.k, s.e, block_m, band);
      }
    }
  });
}

TEST_CASE("routing plan with schedule: one launch up to 4096 slots (one fewer than apart), three above") {
  std::mt19937 rng(5);
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  struct launch_case {
    std::int64_t m;
    int k, e;
    std::size_t fused_nodes;
  };
  for (const launch_case& c : {launch_case{0, 2, 8, 1}, launch_case{64, 8, 256, 1}, launch_case{512, 8, 1024, 1},
                               launch_case{4097, 1, 8, 3}, launch_case{5000, 8, 256, 3}}) {
    CAPTURE(c.m);
    const int block_m = 128;
    const std::int64_t rows = c.m * c.k;
    const auto ids = make_ids(c.m, c.k, c.e, id_pattern::random, rng);
    device_buffer d_ids(ids.size() * sizeof(std::int32_t));
    d_ids.upload(ids);
    const auto view = mr::tensor_view::contiguous(d_ids.get(), mr::dtype::i32, {c.m, c.k}, mr::memory_space::device);
    device_buffer pw(mr::gpu::routing_plan_bytes(c.m, c.k, c.e)), sw(mr::gpu::tile_schedule_bytes(rows, c.e, block_m));
    const capture_result fused = capture_call(stream, [&] {
      mr::gpu::build_routing_plan_and_schedule(view, c.e, block_m, pw.get(), pw.bytes(), sw.get(), sw.bytes(), stream);
    });
    const capture_result apart = capture_call(stream, [&] {
      const auto plan = mr::gpu::build_routing_plan(view, c.e, pw.get(), pw.bytes(), stream);
      mr::gpu::build_tile_schedule(plan, rows, block_m, sw.get(), sw.bytes(), stream);
    });
    CHECK_FALSE(fused.threw);
    CHECK_FALSE(apart.threw);
    CHECK(fused.nodes == c.fused_nodes);
    CHECK(apart.nodes == c.fused_nodes + 1);
  }
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("routing plan with schedule: bad arguments throw before anything is launched or written") {
  const int e = 8, k = 2, block_m = 128;
  const std::int64_t m = 4;
  const std::size_t plan_need = mr::gpu::routing_plan_bytes(m, k, e);
  const std::size_t schedule_need = mr::gpu::tile_schedule_bytes(m * k, e, block_m);
  device_buffer ids(m * k * 4), pw(plan_need + 256), sw(schedule_need + 256);
  ids.poison(0);
  pw.poison(0x5a);
  sw.poison(0x5a);
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  const auto view = mr::tensor_view::contiguous(ids.get(), mr::dtype::i32, {m, k}, mr::memory_space::device);
  auto f32_view = view;
  f32_view.type = mr::dtype::f32;
  auto host_view = view;
  host_view.space = mr::memory_space::host;
  const auto flat = mr::tensor_view::contiguous(ids.get(), mr::dtype::i32, {m * k}, mr::memory_space::device);
  const auto wide = mr::tensor_view::contiguous(ids.get(), mr::dtype::i32, {1, mr::max_top_k + 1}, mr::memory_space::device);
  char* p = static_cast<char*>(pw.get());
  char* s = static_cast<char*>(sw.get());
  struct bad_case {
    const char* what;  // a phrase the message must hold
    mr::tensor_view ids;
    int experts, block_m;
    void* plan_ws;
    std::size_t plan_bytes;
    void* schedule_ws;
    std::size_t schedule_bytes;
  };
  const bad_case cases[] = {
      {"topk_ids", f32_view, e, block_m, p, plan_need, s, schedule_need},
      {"topk_ids", host_view, e, block_m, p, plan_need, s, schedule_need},
      {"topk_ids", flat, e, block_m, p, plan_need, s, schedule_need},
      {"top_k", wide, e, block_m, p, pw.bytes(), s, sw.bytes()},
      {"num_experts", view, 0, block_m, p, plan_need, s, schedule_need},
      {"num_experts", view, mr::gpu::plan_max_experts + 1, block_m, p, pw.bytes(), s, sw.bytes()},
      {"plan_workspace is null", view, e, block_m, nullptr, plan_need, s, schedule_need},
      {"plan_workspace must be 256-byte aligned", view, e, block_m, p + 4, plan_need, s, schedule_need},
      {"plan_workspace holds", view, e, block_m, p, plan_need - 1, s, schedule_need},
      {"schedule_workspace is null", view, e, block_m, p, plan_need, nullptr, schedule_need},
      {"schedule_workspace must be 256-byte aligned", view, e, block_m, p, plan_need, s + 16, schedule_need},
      {"schedule_workspace holds", view, e, block_m, p, plan_need, s, schedule_need - 1},
      {"block_m must be positive", view, e, 0, p, plan_need, s, schedule_need},
      {"block_m must be positive", view, e, -128, p, plan_need, s, schedule_need},
  };
  for (const bad_case& c : cases) {
    CAPTURE(c.what);
    const capture_result r = capture_call(stream, [&] {
      mr::gpu::build_routing_plan_and_schedule(c.ids, c.experts, c.block_m, c.plan_ws, c.plan_bytes, c.schedule_ws,
                                               c.schedule_bytes, stream);
    });
    CHECK(r.threw);
    CHECK_MESSAGE(r.message.find(c.what) != std::string::npos, r.message);
    CHECK_MESSAGE(r.message.find("gpu::build_routing_plan_and_schedule") != std::string::npos, r.message);
    CHECK(r.nodes == 0);
  }

  // build_tile_schedule shares the schedule's checks.
  std::int32_t* offsets = static_cast<std::int32_t*>(pw.get());
  mr::gpu::routing_plan plan;
  plan.expert_offsets = offsets;
  plan.error_flag = offsets;
  plan.num_experts = e;
  plan.top_k = k;
  plan.num_tokens = m;
  const struct {
    const char* what;
    int block_m;
    void* ws;
    std::size_t bytes;
  } schedule_cases[] = {{"workspace is null", block_m, nullptr, schedule_need},
                        {"workspace must be 256-byte aligned", block_m, s + 16, schedule_need},
                        {"workspace holds", block_m, s, schedule_need - 1},
                        {"block_m must be positive", 0, s, schedule_need}};
  for (const auto& c : schedule_cases) {
    CAPTURE(c.what);
    const capture_result r = capture_call(
        stream, [&] { mr::gpu::build_tile_schedule(plan, m * k, c.block_m, c.ws, c.bytes, stream); });
    CHECK(r.threw);
    CHECK_MESSAGE(r.message.find(c.what) != std::string::npos, r.message);
    CHECK(r.nodes == 0);
  }

  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (unsigned char b : pw.download<unsigned char>(pw.bytes())) REQUIRE(b == 0x5a);
  for (unsigned char b : sw.download<unsigned char>(sw.bytes())) REQUIRE(b == 0x5a);
  for (std::int32_t id : ids.download<std::int32_t>(m * k)) REQUIRE(id == 0);
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("routing plan with schedule captured in a CUDA graph replays to the same bits") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct graph_case {
    std::int64_t m;
    int k, e, block_m;
  };
  // Decode (one block), the largest one-block plan, and a tiled plan.
  const graph_case cases[] = {{7, 8, 256, 128}, {512, 8, 1024, 64}, {5000, 8, 256, 128}};
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const auto& g : cases) {
    CAPTURE(g.m);
    CAPTURE(g.e);
    const std::int64_t rows = g.m * g.k;
    auto ids = mr::test::random_ids(g.m, g.k, g.e, 0.1, rng);
    device_buffer d_ids(ids.size() * sizeof(std::int32_t));
    d_ids.upload(ids);
    const auto view = mr::tensor_view::contiguous(d_ids.get(), mr::dtype::i32, {g.m, g.k}, mr::memory_space::device);
    device_buffer pw(mr::gpu::routing_plan_bytes(g.m, g.k, g.e)), sw(mr::gpu::tile_schedule_bytes(rows, g.e, g.block_m));
    mr::gpu::plan_and_schedule built;
    auto run = [&] {
      built = mr::gpu::build_routing_plan_and_schedule(view, g.e, g.block_m, pw.get(), pw.bytes(), sw.get(), sw.bytes(),
                                                       stream);
    };
    auto poison = [&] {
      pw.poison(0xff);
      sw.poison(0xff);
    };
    auto snapshot = [&] {
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<unsigned char> all = pw.download<unsigned char>(pw.bytes());
      const auto sched = sw.download<unsigned char>(sw.bytes());
      all.insert(all.end(), sched.begin(), sched.end());
      return all;
    };

    poison();
    run();
    const auto direct = snapshot();
    check_plan_and_schedule_against_host(built, ids, g.e, g.block_m);
    const captured_run graph(stream, run);
    graph.check_replays(poison, snapshot, direct);

    // New ids in the same buffer: the replay plans and schedules them.
    ids = mr::test::random_ids(g.m, g.k, g.e, 0.1, rng);
    d_ids.upload(ids);
    poison();
    graph.replay();
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    check_plan_and_schedule_against_host(built, ids, g.e, g.block_m);
  }
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("routing plan with schedule: bad ids reach the status word under CUDA graph replay") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const size_case& s : {size_case{7, 8, 256}, size_case{5000, 8, 256}}) {  // one block, tiles
    CAPTURE(s.m);
    const auto n = static_cast<std::size_t>(s.m) * s.k;
    const std::vector<std::int32_t> good = mr::test::random_ids(s.m, s.k, s.e, 0.1, rng);
    std::vector<std::int32_t> bad = good;
    bad[n - 1] = -3;
    bad[n / 2] = s.e + 5;
    device_buffer d_ids(n * sizeof(std::int32_t));
    const auto view = mr::tensor_view::contiguous(d_ids.get(), mr::dtype::i32, {s.m, s.k}, mr::memory_space::device);
    device_buffer pw(mr::gpu::routing_plan_bytes(s.m, s.k, s.e)), sw(mr::gpu::tile_schedule_bytes(static_cast<std::int64_t>(n), s.e, 128));
    mr::test::device_status status;
    // The caller's zeroing captured with the build, as an engine captures a step.
    const captured_run graph(stream, [&] {
      MOE_CUDA_CHECK(cudaMemsetAsync(status.get(), 0, sizeof(mr::moe_status), stream));
      mr::gpu::build_routing_plan_and_schedule(view, s.e, 128, pw.get(), pw.bytes(), sw.get(), sw.bytes(), stream,
                                               false, status.get());
    });
    auto replay_with = [&](const std::vector<std::int32_t>& ids) {
      d_ids.upload(ids);
      graph.replay();
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      return status.read();
    };
    for (int r = 0; r < 3; ++r) {
      const mr::moe_status st = replay_with(bad);
      CHECK(st.bad_slots == 2);
      CHECK(st.first_bad_slot == static_cast<int>(n / 2));
    }
    const mr::moe_status clean = replay_with(good);
    CHECK(clean.bad_slots == 0);
    CHECK(clean.first_bad_slot == 0);
  }
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

int main(int argc, char** argv) {
  if (!mr::test::have_gpu()) {
    std::puts("no GPU: skipping the routing kernel tests");
    return mr::test::skip_exit_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}

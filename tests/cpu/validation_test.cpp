// Every validated field rejected with its message, and nothing written on a rejected call:
// outputs (and, for inplace, the input) are filled with a sentinel first and compared after.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::host_tensor;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();

mr::MoeRunnerConfig config_of(mr::moe_config_params p) { return mr::MoeRunnerConfig(p); }

constexpr mr::moe_config_params valid_params{.num_experts = 4, .hidden_size = 8, .intermediate_size = 4, .top_k = 2};

void expect_config_error(mr::moe_config_params p, const std::string& what) {
  CHECK_THROWS_WITH_AS(config_of(p), ("MoeRunnerConfig: " + what).c_str(), mr::invalid_argument_error);
}

}  // namespace

TEST_CASE("MoeRunnerConfig rejects each invalid field with its message") {
  auto p = valid_params;
  p.num_experts = 0;
  expect_config_error(p, "num_experts must be in [1, 4096], got 0");
  p.num_experts = 4097;
  p.top_k = 1;
  expect_config_error(p, "num_experts must be in [1, 4096], got 4097");

  p = valid_params;
  p.num_local_experts = -1;
  expect_config_error(p, "num_local_experts must be in [1, num_experts=4], got -1");
  p.num_local_experts = 5;
  expect_config_error(p, "num_local_experts must be in [1, num_experts=4], got 5");

  p = valid_params;
  p.hidden_size = 0;
  expect_config_error(p, "hidden_size must be in [1, 1048576], got 0");
  p.hidden_size = -8;
  expect_config_error(p, "hidden_size must be in [1, 1048576], got -8");
  p.hidden_size = (1 << 20) + 1;
  expect_config_error(p, "hidden_size must be in [1, 1048576], got 1048577");

  p = valid_params;
  p.intermediate_size = 0;
  expect_config_error(p, "intermediate_size must be in [1, 1048576], got 0");
  p.intermediate_size = -3;
  expect_config_error(p, "intermediate_size must be in [1, 1048576], got -3");
  // 2I rows would overflow int.
  p.intermediate_size = 1 << 30;
  expect_config_error(p, "intermediate_size must be in [1, 1048576], got 1073741824");

  p = valid_params;
  p.top_k = 0;
  expect_config_error(p, "top_k must be in [1, min(num_experts, 32)], got 0");
  p.top_k = 5;
  expect_config_error(p, "top_k must be in [1, min(num_experts, 32)], got 5");
  p.num_experts = 64;
  p.top_k = 33;
  expect_config_error(p, "top_k must be in [1, min(num_experts, 32)], got 33");

  for (float f : {0.0f, -1.0f, inf_f, -inf_f, nan_f}) {
    p = valid_params;
    p.routed_scaling_factor = f;
    expect_config_error(p, "routed_scaling_factor must be finite and positive");
  }

  p = valid_params;
  p.act.kind = mr::activation_kind::swiglu_clamped;
  p.is_gated = false;
  expect_config_error(p, "swiglu_clamped needs is_gated = true");
  for (float a : {0.0f, -1.0f, inf_f, nan_f}) {
    p = valid_params;
    p.act = {mr::activation_kind::swiglu_clamped, a, 7.0f};
    expect_config_error(p, "swiglu_clamped alpha must be finite and positive");
    p.act = {mr::activation_kind::swiglu_clamped, 1.702f, a};
    expect_config_error(p, "swiglu_clamped limit must be finite and positive");
  }

  // An enum value made by a cast would otherwise run as no activation at all (zeros).
  for (int kind : {3, 255}) {
    p = valid_params;
    p.act.kind = static_cast<mr::activation_kind>(kind);
    expect_config_error(p, "act.kind must be silu, gelu or swiglu_clamped, got the value " + std::to_string(kind));
  }

  p = valid_params;
  p.gate_up_layout = static_cast<mr::w13_layout>(7);
  expect_config_error(p, "gate_up_layout must be halves or interleaved, got 7");
  p.gate_up_layout = mr::w13_layout::interleaved;
  p.is_gated = false;
  expect_config_error(p, "gate_up_layout interleaved needs is_gated = true (w13 has no up rows to interleave)");

  p = valid_params;
  p.apply_router_weight_on_input = true;
  expect_config_error(p, "apply_router_weight_on_input needs top_k = 1 (the weight scales the shared input row)");

  p = valid_params;
  p.inplace = true;
  p.no_combine = true;
  expect_config_error(p, "inplace and no_combine exclude each other");
}

TEST_CASE("MoeRunnerConfig accepts the boundaries and fills in the defaults") {
  auto p = valid_params;
  p.num_experts = 4096;
  p.top_k = 32;
  const auto big = config_of(p);
  CHECK(big.num_local_experts() == 4096);
  CHECK(big.top_k() == 32);
  p = valid_params;
  p.num_local_experts = 4;
  p.top_k = 4;
  CHECK(config_of(p).num_local_experts() == 4);
  // alpha and limit only matter for the clamped swiglu.
  p = valid_params;
  p.act = {mr::activation_kind::gelu, nan_f, -1.0f};
  CHECK_NOTHROW(config_of(p));
  p = valid_params;
  p.is_gated = false;
  CHECK(config_of(p).w13_rows() == 4);
  CHECK(config_of(valid_params).w13_rows() == 8);
  p = valid_params;
  p.top_k = 1;
  p.apply_router_weight_on_input = true;
  p.routed_scaling_factor = 1e-30f;
  CHECK_NOTHROW(config_of(p));
  p = valid_params;
  p.hidden_size = p.intermediate_size = mr::max_feature_size;
  CHECK(config_of(p).w13_rows() == 2 * mr::max_feature_size);
}

TEST_CASE("every limit error quotes the limit of core/limits.hpp") {
  auto p = valid_params;
  p.num_experts = mr::max_num_experts + 1;
  p.top_k = 1;
  expect_config_error(p, "num_experts must be in [1, " + std::to_string(mr::max_num_experts) + "], got " +
                             std::to_string(mr::max_num_experts + 1));
  p = valid_params;
  p.num_experts = 2 * mr::max_top_k;
  p.top_k = mr::max_top_k + 1;
  expect_config_error(p, "top_k must be in [1, min(num_experts, " + std::to_string(mr::max_top_k) + ")], got " +
                             std::to_string(mr::max_top_k + 1));
  p = valid_params;
  p.hidden_size = mr::max_feature_size + 1;
  expect_config_error(p, "hidden_size must be in [1, " + std::to_string(mr::max_feature_size) + "], got " +
                             std::to_string(mr::max_feature_size + 1));
  // Routing's own (narrower) limits, read by reference::topk and gpu::topk alike.
  static_assert(mr::routing::max_routing_top_k <= mr::max_top_k);
  static_assert(mr::routing::max_routing_experts <= mr::max_num_experts);
  static_assert(mr::max_gpu_local_experts <= mr::max_num_experts);
  const int e = mr::routing::max_routing_experts + 1;
  std::vector<float> logits(static_cast<std::size_t>(e)), w(1);
  std::vector<std::int32_t> ids(1);
  const auto host = mr::memory_space::host;
  mr::TopKOutput out{mr::tensor_view::contiguous(w.data(), mr::dtype::f32, {1, 1}, host),
                     mr::tensor_view::contiguous(ids.data(), mr::dtype::i32, {1, 1}, host)};
  CHECK_THROWS_WITH_AS(mr::reference::topk(mr::tensor_view::contiguous(logits.data(), mr::dtype::f32, {1, e}, host), nullptr,
                                           {.top_k = 1}, out),
                       ("reference::topk: routing supports at most " + std::to_string(mr::routing::max_routing_experts) +
                        " experts, got " + std::to_string(e))
                           .c_str(),
                       mr::invalid_argument_error);
}

TEST_CASE("tensor_view refuses a rank above 4") {
  CHECK_THROWS_WITH_AS(mr::tensor_view::contiguous(nullptr, mr::dtype::f32, {1, 2, 3, 4, 5}, mr::memory_space::host),
                       "tensor_view::contiguous: rank above 4", mr::invalid_argument_error);
}

TEST_CASE("tensor_view::contiguous refuses negative dimensions and sizes int64 cannot count") {
  const auto host = mr::memory_space::host;
  const auto contiguous_error = [&](std::initializer_list<std::int64_t> dims, mr::dtype t, const std::string& what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(mr::tensor_view::contiguous(nullptr, t, dims, host), ("tensor_view::contiguous: " + what).c_str(),
                         mr::invalid_argument_error);
  };
  contiguous_error({-1, 8}, mr::dtype::f32, "a tensor of shape [-1, 8] dimension 0 is negative (-1)");
  contiguous_error({4, 2, -3}, mr::dtype::bf16, "a tensor of shape [4, 2, -3] dimension 2 is negative (-3)");
  contiguous_error({std::int64_t{1} << 32, std::int64_t{1} << 32}, mr::dtype::f32,
                   "a tensor of shape [4294967296, 4294967296] spans more bytes than int64 can count");
  // 2^61 f32 elements: the element count fits, the byte count does not.
  contiguous_error({std::int64_t{1} << 61}, mr::dtype::f32,
                   "a tensor of shape [2305843009213693952] spans more bytes than int64 can count");
  // An empty tensor still has strides: they must be exact too.
  contiguous_error({0, std::int64_t{1} << 40, std::int64_t{1} << 40}, mr::dtype::f32,
                   "a tensor of shape [0, 1099511627776, 1099511627776] spans more bytes than int64 can count");
  contiguous_error({2}, static_cast<mr::dtype>(9), "a tensor of shape [2] has an unknown dtype (value 9)");
  CHECK_THROWS_WITH_AS(mr::tensor_view::contiguous(nullptr, mr::dtype::f32, {2}, static_cast<mr::memory_space>(5)),
                       "tensor_view::contiguous: a tensor of shape [2] has an unknown memory space (value 5)",
                       mr::invalid_argument_error);
  // The largest representable sizes are fine.
  const auto big = mr::tensor_view::contiguous(nullptr, mr::dtype::f8_e4m3, {std::int64_t{1} << 31, std::int64_t{1} << 31}, host);
  CHECK(big.strides[0] == std::int64_t{1} << 31);
  CHECK(big.bytes() == std::size_t{1} << 62);
  // What an engine catches: a moe_error, never a std::length_error from deeper down.
  CHECK_THROWS_AS(mr::tensor_view::contiguous(nullptr, mr::dtype::bf16, {-1, 4096}, host), mr::moe_error);
}

// ---- reference::topk -------------------------------------------------------------------

namespace {

struct topk_fixture {
  int m = 3, e = 8;
  host_tensor logits{mr::dtype::f32, {3, 8}}, bias{mr::dtype::f32, {8}};
  host_tensor w{mr::dtype::f32, {3, 2}}, ids{mr::dtype::i32, {3, 2}};
  topk_fixture() {
    std::mt19937 rng(1);
    mr::cpu_test::fill_uniform(logits, rng, -1, 1);
    mr::cpu_test::fill_uniform(bias, rng, -0.1f, 0.1f);
    mr::cpu_test::fill_sentinel(w);
    mr::cpu_test::fill_sentinel(ids);
  }
};

// Calls topk with one thing changed; expects the message and untouched outputs.
void expect_topk_error(const std::function<void(mr::tensor_view& logits, mr::tensor_view*& bias, mr::topk_config& cfg,
                                                mr::TopKOutput& out)>& mutate,
                       const std::string& what) {
  CAPTURE(what);
  topk_fixture f;
  mr::tensor_view logits = f.logits.view;
  mr::tensor_view bias_view = f.bias.view;
  mr::tensor_view* bias = &bias_view;
  mr::topk_config cfg{.top_k = 2};
  mr::TopKOutput out{f.w.view, f.ids.view};
  mutate(logits, bias, cfg, out);
  const auto w_before = f.w.bytes(), ids_before = f.ids.bytes();
  CHECK_THROWS_WITH_AS(mr::reference::topk(logits, bias, cfg, out), ("reference::topk: " + what).c_str(),
                       mr::invalid_argument_error);
  CHECK(f.w.bytes() == w_before);
  CHECK(f.ids.bytes() == ids_before);
  CHECK_FALSE(out.routed_scaling_applied);
}

using tv = mr::tensor_view;

// Gives a view new dimensions with matching row-major strides, so only the size is wrong.
void reshape(tv& t, std::initializer_list<std::int64_t> dims) { t = tv::contiguous(t.data, t.type, dims, t.space); }

}  // namespace

TEST_CASE("reference::topk rejects each invalid setting with its message and writes nothing") {
  using cfg_t = mr::topk_config;
  using out_t = mr::TopKOutput;
  // The fixture itself is valid.
  {
    topk_fixture f;
    mr::TopKOutput out{f.w.view, f.ids.view};
    CHECK_NOTHROW(mr::reference::topk(f.logits.view, &f.bias.view, {.top_k = 2}, out));
  }
  // topk_config fields.
  expect_topk_error([](tv&, tv*&, cfg_t& c, out_t& o) { c.top_k = 0; o.topk_weights.shape[1] = o.topk_ids.shape[1] = 0; },
                    "top_k must be in [1, min(num_experts, 16)], got 0");
  expect_topk_error([](tv&, tv*&, cfg_t& c, out_t&) { c.top_k = 9; }, "top_k must be in [1, min(num_experts, 16)], got 9");
  expect_topk_error(
      [](tv& l, tv*& b, cfg_t& c, out_t&) {
        reshape(l, {3, 40});
        b = nullptr;
        c.top_k = 17;
      },
      "top_k must be in [1, min(num_experts, 16)], got 17");
  expect_topk_error(
      [](tv& l, tv*& b, cfg_t&, out_t&) {
        reshape(l, {3, 513});
        b = nullptr;
      },
      "routing supports at most 512 experts, got 513");
  for (float f : {0.0f, -2.0f, inf_f, nan_f})
    expect_topk_error([f](tv&, tv*&, cfg_t& c, out_t&) { c.routed_scaling_factor = f; },
                      "routed_scaling_factor must be finite and positive");
  expect_topk_error(
      [](tv&, tv*&, cfg_t& c, out_t&) {
        c.num_expert_group = 3;
        c.topk_group = 1;
      },
      "num_expert_group must divide num_experts (8), got 3");
  expect_topk_error(
      [](tv& l, tv*& b, cfg_t& c, out_t&) {
        reshape(l, {3, 128});
        b = nullptr;
        c.num_expert_group = 64;
        c.topk_group = 1;
      },
      "num_expert_group must be at most 32");
  expect_topk_error(
      [](tv&, tv*&, cfg_t& c, out_t&) {
        c.num_expert_group = 4;
        c.topk_group = 0;
      },
      "topk_group must be in [1, num_expert_group], got 0");
  expect_topk_error(
      [](tv&, tv*&, cfg_t& c, out_t&) {
        c.num_expert_group = 4;
        c.topk_group = 5;
      },
      "topk_group must be in [1, num_expert_group], got 5");
  expect_topk_error(
      [](tv&, tv*&, cfg_t& c, out_t& o) {
        c.num_expert_group = 8;
        c.topk_group = 2;
        c.top_k = 3;
        o.topk_weights.shape[1] = o.topk_ids.shape[1] = 3;
      },
      "the kept groups hold fewer experts than top_k");
  expect_topk_error([](tv&, tv*&, cfg_t& c, out_t&) { c.topk_group = 1; }, "topk_group is set but num_expert_group is 0");
  expect_topk_error([](tv&, tv*&, cfg_t& c, out_t&) { c.num_expert_group = -2; },
                    "num_expert_group must be at least 0 (0: no grouping), got -2");
  expect_topk_error([](tv&, tv*&, cfg_t& c, out_t&) { c.scoring = static_cast<mr::scoring_func>(2); },
                    "scoring must be softmax or sigmoid, got the value 2");

  // router_logits.
  expect_topk_error(
      [](tv& l, tv*&, cfg_t&, out_t&) {
        l.rank = 1;
        l.shape = {24};
        l.strides = {1};
      },
      "router_logits must have rank 2, got shape [24]");
  expect_topk_error([](tv& l, tv*&, cfg_t&, out_t&) { l.space = mr::memory_space::device; },
                    "router_logits must live in host memory, got device");
  expect_topk_error([](tv& l, tv*&, cfg_t&, out_t&) { l.strides = {1, 3}; }, "router_logits must be contiguous (row-major)");
  expect_topk_error([](tv& l, tv*&, cfg_t&, out_t&) { l.data = nullptr; }, "router_logits has a null data pointer");
  expect_topk_error([](tv& l, tv*&, cfg_t&, out_t&) { l.shape[0] = -1; },
                    "router_logits dimension 0 is negative (-1), got shape [-1, 8]");
  expect_topk_error([](tv& l, tv*&, cfg_t&, out_t&) { l.data = static_cast<char*>(l.data) + 2; },
                    "router_logits must be 4-byte aligned (its f32 elements are read in place)");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_ids.data = static_cast<char*>(o.topk_ids.data) + 1; },
                    "topk_ids must be 4-byte aligned (its i32 elements are read in place)");
  expect_topk_error([](tv& l, tv*&, cfg_t&, out_t&) { l.type = mr::dtype::i32; },
                    "router_logits must be f32, f16 or bf16, got i32");
  expect_topk_error([](tv& l, tv*&, cfg_t&, out_t&) { l.type = mr::dtype::f8_e4m3; },
                    "router_logits must be f32, f16 or bf16, got f8_e4m3");
  expect_topk_error(
      [](tv& l, tv*& b, cfg_t&, out_t&) {
        l.shape[1] = 0;
        l.strides = {0, 1};
        b = nullptr;
      },
      "router_logits must have at least one expert column");

  // correction_bias.
  expect_topk_error(
      [](tv&, tv*& b, cfg_t&, out_t&) {
        b->rank = 2;
        b->shape = {1, 8};
        b->strides = {8, 1};
      },
      "correction_bias must have rank 1, got shape [1, 8]");
  expect_topk_error([](tv&, tv*& b, cfg_t&, out_t&) { b->type = mr::dtype::bf16; }, "correction_bias must be f32, got bf16");
  expect_topk_error([](tv&, tv*& b, cfg_t&, out_t&) { b->space = mr::memory_space::device; },
                    "correction_bias must live in host memory, got device");
  expect_topk_error([](tv&, tv*& b, cfg_t&, out_t&) { b->strides = {2}; }, "correction_bias must be contiguous (row-major)");
  expect_topk_error([](tv&, tv*& b, cfg_t&, out_t&) { b->data = nullptr; }, "correction_bias has a null data pointer");
  expect_topk_error([](tv&, tv*& b, cfg_t&, out_t&) { b->shape = {7}; },
                    "correction_bias dimension 0 must be 8, got shape [7]");

  // Outputs.
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_weights.type = mr::dtype::bf16; },
                    "topk_weights must be f32, got bf16");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_ids.type = mr::dtype::f32; }, "topk_ids must be i32, got f32");
  expect_topk_error(
      [](tv&, tv*&, cfg_t&, out_t& o) {
        o.topk_weights.rank = 1;
        o.topk_weights.shape = {6};
        o.topk_weights.strides = {1};
      },
      "topk_weights must have rank 2, got shape [6]");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_ids.space = mr::memory_space::device; },
                    "topk_ids must live in host memory, got device");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_weights.strides = {1, 3}; },
                    "topk_weights must be contiguous (row-major)");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_ids.data = nullptr; }, "topk_ids has a null data pointer");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_weights.shape[0] = 2; },
                    "topk_weights dimension 0 must be 3, got shape [2, 2]");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { reshape(o.topk_weights, {3, 3}); },
                    "topk_weights dimension 1 must be 2, got shape [3, 3]");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { o.topk_ids.shape[0] = 4; },
                    "topk_ids dimension 0 must be 3, got shape [4, 2]");
  expect_topk_error([](tv&, tv*&, cfg_t&, out_t& o) { reshape(o.topk_ids, {3, 1}); },
                    "topk_ids dimension 1 must be 2, got shape [3, 1]");
}

// ---- MoeRunner::run --------------------------------------------------------------------

namespace {

using unquant_only = mr::cpu_test::echo_policy<"unquant_only">;
using needs_workspace = mr::cpu_test::echo_policy<"needs_workspace", 64>;

// A valid call: M=3, E=4, H=8, I=4, k=2, f32. Cases change one thing.
struct run_fixture {
  static constexpr int m = 3, e = 4, h = 8, inter = 4, k = 2;
  host_tensor x{mr::dtype::f32, {m, h}}, wts{mr::dtype::f32, {m, k}}, ids{mr::dtype::i32, {m, k}};
  host_tensor w13{mr::dtype::f32, {e, 2 * inter, h}}, w2{mr::dtype::f32, {e, h, inter}};
  host_tensor out{mr::dtype::f32, {m, h}}, out3{mr::dtype::f32, {m, k, h}}, out_bf16{mr::dtype::bf16, {m, h}};
  host_tensor x8{mr::dtype::f8_e4m3, {m, h}}, x8_scales{mr::dtype::f32, {m, 1}};
  host_tensor q13{mr::dtype::f8_e4m3, {e, 2 * inter, h}}, q2{mr::dtype::f8_e4m3, {e, h, inter}};
  host_tensor s13{mr::dtype::f32, {e, 1, 1}}, s2{mr::dtype::f32, {e, 1, 1}};
  host_tensor b13{mr::dtype::f32, {e, 2 * inter}}, b2{mr::dtype::f32, {e, h}};
  host_tensor b13_f16{mr::dtype::f16, {e, 2 * inter}}, b2_bf16{mr::dtype::bf16, {e, h}};
  std::vector<unsigned char> ws = std::vector<unsigned char>(1024);

  run_fixture() {
    std::mt19937 rng(3);
    for (host_tensor* t : {&x, &wts, &w13, &w2, &s13, &s2, &x8_scales, &b13, &b2, &b13_f16, &b2_bf16})
      mr::cpu_test::fill_uniform(*t, rng, 0.1f, 1.0f);
    for (host_tensor* t : {&x8, &q13, &q2}) mr::cpu_test::fill_uniform(*t, rng, -2.0f, 2.0f);
    for (int i = 0; i < m * k; ++i) ids.ptr<std::int32_t>()[i] = i % e;
    for (host_tensor* t : {&out, &out3, &out_bf16}) mr::cpu_test::fill_sentinel(*t);
  }
};

struct run_call {
  mr::DispatchOutput d;
  mr::tensor_view out;
  mr::unquantized_quant_info q;
  mr::fp8_block_quant_info q8;
  mr::workspace_view ws;
  bool fp8 = false;
  const mr::lora_hooks* lora = nullptr;
};

run_call valid_call(run_fixture& f) {
  run_call c;
  c.d = {f.x.view, {}, {f.wts.view, f.ids.view}};
  c.out = f.out.view;
  c.q = {f.w13.view, f.w2.view};
  c.q8 = {f.q13.view, f.s13.view, f.q2.view, f.s2.view};
  c.ws = {f.ws.data(), f.ws.size()};
  return c;
}

// Builds the runner the case asks for, runs the changed call, and checks the message,
// the exception type and that no buffer of the fixture changed.
template <class Error = mr::invalid_argument_error, class... Policies>
void expect_run_error(const std::string& backend, mr::moe_config_params params,
                      const std::function<void(run_fixture&, run_call&)>& mutate, const std::string& what) {
  CAPTURE(what);
  run_fixture f;
  run_call c = valid_call(f);
  mutate(f, c);
  const auto snapshot = [&] {
    std::vector<std::vector<unsigned char>> s;
    for (host_tensor* t : {&f.x, &f.wts, &f.ids, &f.out, &f.out3, &f.out_bf16, &f.x8}) s.push_back(t->bytes());
    return s;
  };
  const auto before = snapshot();
  mr::MoeRunner<Policies...> runner(backend, mr::MoeRunnerConfig(params));
  if (c.fp8)
    CHECK_THROWS_WITH_AS(runner.run(c.d, c.q8, c.out, c.ws, mr::cpu_test::host_stream(), c.lora), what.c_str(), Error);
  else
    CHECK_THROWS_WITH_AS(runner.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream(), c.lora), what.c_str(), Error);
  CHECK(snapshot() == before);
}

constexpr mr::moe_config_params run_params{.num_experts = 4, .hidden_size = 8, .intermediate_size = 4, .top_k = 2};

void expect_ref_error(const std::function<void(run_fixture&, run_call&)>& mutate, const std::string& what,
                      mr::moe_config_params params = run_params) {
  expect_run_error<mr::invalid_argument_error, mr::reference_policy>("reference", params, mutate,
                                                                     "MoeRunner::run: " + what);
}

using rf = run_fixture;
using rc = run_call;

}  // namespace

TEST_CASE("the valid calls the cases start from run") {
  run_fixture f;
  for (bool fp8 : {false, true}) {
    run_call c = valid_call(f);
    mr::MoeRunner<mr::reference_policy> r("reference", mr::MoeRunnerConfig(run_params));
    if (fp8) {
      CHECK_NOTHROW(r.run(c.d, c.q8, c.out, c.ws, mr::cpu_test::host_stream()));
    } else {
      CHECK_NOTHROW(r.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()));
    }
  }
  run_call c = valid_call(f);
  c.d.hidden_states = f.x8.view;
  c.d.hidden_scales = f.x8_scales.view;
  c.out = f.out_bf16.view;
  mr::MoeRunner<mr::reference_policy> r("reference", mr::MoeRunnerConfig(run_params));
  CHECK_NOTHROW(r.run(c.d, c.q8, c.out, c.ws, mr::cpu_test::host_stream()));
  for (std::int64_t i = 0; i < f.out.numel(); ++i) CHECK(std::isfinite(f.out.ptr<float>()[i]));
}

TEST_CASE("run rejects bad hidden states") {
  expect_ref_error(
      [](rf&, rc& c) {
        c.d.hidden_states.rank = 3;
        c.d.hidden_states.shape = {3, 8, 1};
        c.d.hidden_states.strides = {8, 1, 1};
      },
      "hidden_states must have rank 2, got shape [3, 8, 1]");
  expect_ref_error([](rf&, rc& c) { c.d.hidden_states.space = mr::memory_space::device; },
                   "hidden_states must live in host memory, got device");
  expect_ref_error([](rf&, rc& c) { c.d.hidden_states.strides = {16, 1}; }, "hidden_states must be contiguous (row-major)");
  expect_ref_error([](rf&, rc& c) { c.d.hidden_states.strides = {1, 3}; }, "hidden_states must be contiguous (row-major)");
  expect_ref_error([](rf&, rc& c) { c.d.hidden_states.data = nullptr; }, "hidden_states has a null data pointer");
  expect_ref_error([](rf&, rc& c) { c.d.hidden_states.type = mr::dtype::i32; },
                   "hidden_states must be f32, f16, bf16 or f8_e4m3, got i32");
  expect_ref_error(
      [](rf&, rc& c) {
        c.d.hidden_states.shape = {3, 7};
        c.d.hidden_states.strides = {7, 1};
      },
      "hidden_states dimension 1 must be 8, got shape [3, 7]");
}

TEST_CASE("run rejects views that cannot describe memory: negative, overflowing, unknown") {
  expect_ref_error([](rf&, rc& c) { c.d.hidden_states.shape[0] = -1; },
                   "hidden_states dimension 0 is negative (-1), got shape [-1, 8]");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_ids.shape[1] = -2; },
                   "topk_ids dimension 1 is negative (-2), got shape [3, -2]");
  expect_ref_error([](rf&, rc& c) { c.out.shape[0] = std::int64_t{1} << 62; },
                   "output spans more bytes than int64 can count, got shape [4611686018427387904, 8]");
  expect_ref_error([](rf&, rc& c) { c.q.w13.type = static_cast<mr::dtype>(9); },
                   "w13 has an unknown dtype (value 9), got shape [4, 8, 8]");
  expect_ref_error([](rf&, rc& c) { c.q.w2.space = static_cast<mr::memory_space>(3); },
                   "w2 has an unknown memory space (value 3), got shape [4, 8, 4]");
  // A rank outside [0, 4] is reported without reading past the shape array.
  expect_ref_error([](rf&, rc& c) { c.d.hidden_states.rank = 7; }, "hidden_states has rank 7, outside [0, 4], got shape (rank 7)");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_weights.rank = -1; },
                   "topk_weights has rank -1, outside [0, 4], got shape (rank -1)");
}

TEST_CASE("run rejects host tensors that are not aligned to their element type") {
  const auto shifted = [](mr::tensor_view& t, int bytes) { t.data = static_cast<char*>(t.data) + bytes; };
  expect_ref_error([&](rf&, rc& c) { shifted(c.d.hidden_states, 1); },
                   "hidden_states must be 4-byte aligned (its f32 elements are read in place)");
  expect_ref_error([&](rf&, rc& c) { shifted(c.d.topk.topk_weights, 2); },
                   "topk_weights must be 4-byte aligned (its f32 elements are read in place)");
  expect_ref_error([&](rf&, rc& c) { shifted(c.d.topk.topk_ids, 3); },
                   "topk_ids must be 4-byte aligned (its i32 elements are read in place)");
  expect_ref_error([&](rf&, rc& c) { shifted(c.q.w13, 1); }, "w13 must be 4-byte aligned (its f32 elements are read in place)");
  expect_ref_error([&](rf&, rc& c) { shifted(c.out, 2); }, "output must be 4-byte aligned (its f32 elements are read in place)");
  expect_ref_error(
      [&](rf& f, rc& c) {
        c.out = f.out_bf16.view;
        c.d.hidden_states.type = c.q.w13.type = c.q.w2.type = mr::dtype::bf16;
        shifted(c.q.w2, 1);
      },
      "w2 must be 2-byte aligned (its bf16 elements are read in place)");
  expect_ref_error(
      [&](rf&, rc& c) {
        c.fp8 = true;
        shifted(c.q8.w2_scale, 2);
      },
      "w2_scale must be 4-byte aligned (its f32 elements are read in place)");
  // fp8 elements are single bytes: any address will do (host_tensor leaves slack past the end).
  run_fixture f;
  run_call c = valid_call(f);
  shifted(c.q8.w13, 1);
  mr::MoeRunner<mr::reference_policy> r("reference", mr::MoeRunnerConfig(run_params));
  CHECK_NOTHROW(r.run(c.d, c.q8, c.out, c.ws, mr::cpu_test::host_stream()));
}

TEST_CASE("run rejects bad routing tensors") {
  expect_ref_error(
      [](rf&, rc& c) {
        c.d.topk.topk_weights.rank = 1;
        c.d.topk.topk_weights.shape = {6};
        c.d.topk.topk_weights.strides = {1};
      },
      "topk_weights must have rank 2, got shape [6]");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_weights.type = mr::dtype::bf16; }, "topk_weights must be f32, got bf16");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_weights.space = mr::memory_space::device; },
                   "topk_weights must live in host memory, got device");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_weights.strides = {1, 3}; }, "topk_weights must be contiguous (row-major)");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_weights.data = nullptr; }, "topk_weights has a null data pointer");
  expect_ref_error(
      [](rf&, rc& c) {
        c.d.topk.topk_weights.shape = {2, 2};
      },
      "topk_weights dimension 0 must be 3, got shape [2, 2]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.d.topk.topk_weights.shape = {3, 1};
        c.d.topk.topk_weights.strides = {1, 1};
      },
      "topk_weights dimension 1 must be 2, got shape [3, 1]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.d.topk.topk_ids.rank = 3;
        c.d.topk.topk_ids.shape = {3, 2, 1};
        c.d.topk.topk_ids.strides = {2, 1, 1};
      },
      "topk_ids must have rank 2, got shape [3, 2, 1]");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_ids.type = mr::dtype::f32; }, "topk_ids must be i32, got f32");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_ids.space = mr::memory_space::device; },
                   "topk_ids must live in host memory, got device");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_ids.strides = {4, 1}; }, "topk_ids must be contiguous (row-major)");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_ids.data = nullptr; }, "topk_ids has a null data pointer");
  expect_ref_error([](rf&, rc& c) { c.d.topk.topk_ids.shape = {4, 2}; }, "topk_ids dimension 0 must be 3, got shape [4, 2]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.d.topk.topk_ids.shape = {3, 3};
        c.d.topk.topk_ids.strides = {3, 1};
      },
      "topk_ids dimension 1 must be 2, got shape [3, 3]");
}

TEST_CASE("run rejects a bad output") {
  expect_ref_error(
      [](rf&, rc& c) {
        c.out.rank = 3;
        c.out.shape = {3, 8, 1};
        c.out.strides = {8, 1, 1};
      },
      "output must have rank 2, got shape [3, 8, 1]");
  expect_ref_error([](rf&, rc& c) { c.out.shape = {2, 8}; }, "output dimension 0 must be 3, got shape [2, 8]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.out.shape = {3, 4};
        c.out.strides = {4, 1};
      },
      "output dimension 1 must be 8, got shape [3, 4]");
  expect_ref_error([](rf& f, rc& c) { c.out = f.out_bf16.view; }, "output must be f32 to match hidden_states, got bf16");
  expect_ref_error([](rf&, rc& c) { c.out.space = mr::memory_space::device; }, "output must live in host memory, got device");
  expect_ref_error([](rf&, rc& c) { c.out.strides = {1, 3}; }, "output must be contiguous (row-major)");
  expect_ref_error([](rf&, rc& c) { c.out.data = nullptr; }, "output has a null data pointer");
  // The output may not overlap the input unless inplace is asked for.
  expect_ref_error([](rf&, rc& c) { c.out.data = c.d.hidden_states.data; },
                   "output overlaps hidden_states; set inplace to write over the input");
  expect_ref_error([](rf& f, rc& c) { c.out.data = f.x.ptr<float>() + 5; },
                   "output overlaps hidden_states; set inplace to write over the input");

  auto no_combine = run_params;
  no_combine.no_combine = true;
  expect_ref_error([](rf&, rc&) {}, "output must have rank 3, got shape [3, 8]", no_combine);
  expect_ref_error([](rf& f, rc& c) { c.out = f.out3.view; c.out.shape[0] = 2; },
                   "output dimension 0 must be 3, got shape [2, 2, 8]", no_combine);
  expect_ref_error(
      [](rf& f, rc& c) {
        c.out = f.out3.view;
        c.out.shape = {3, 1, 8};
        c.out.strides = {8, 8, 1};
      },
      "output dimension 1 must be 2, got shape [3, 1, 8]", no_combine);
  expect_ref_error([](rf& f, rc& c) { c.out = f.out3.view; reshape(c.out, {3, 2, 7}); },
                   "output dimension 2 must be 8, got shape [3, 2, 7]", no_combine);

  auto inplace = run_params;
  inplace.inplace = true;
  expect_ref_error([](rf&, rc&) {}, "inplace is set but output does not alias hidden_states", inplace);
  expect_ref_error([](rf& f, rc& c) { c.out.data = f.x.ptr<float>() + 1; },
                   "inplace is set but output does not alias hidden_states", inplace);
}

TEST_CASE("run rejects fp8 hidden states without proper scales, and a non-bf16 output for them") {
  const auto fp8_input = [](rf& f, rc& c) {
    c.d.hidden_states = f.x8.view;
    c.d.hidden_scales = f.x8_scales.view;
    c.out = f.out_bf16.view;
    c.fp8 = true;
  };
  expect_ref_error([&](rf& f, rc& c) { fp8_input(f, c); c.d.hidden_scales = {}; },
                   "hidden_scales must have rank 2, got shape []");
  expect_ref_error([&](rf& f, rc& c) { fp8_input(f, c); c.d.hidden_scales.type = mr::dtype::bf16; },
                   "hidden_scales must be f32, got bf16");
  expect_ref_error([&](rf& f, rc& c) { fp8_input(f, c); c.d.hidden_scales.space = mr::memory_space::device; },
                   "hidden_scales must live in host memory, got device");
  expect_ref_error([&](rf& f, rc& c) { fp8_input(f, c); c.d.hidden_scales.data = nullptr; },
                   "hidden_scales has a null data pointer");
  expect_ref_error([&](rf& f, rc& c) { fp8_input(f, c); c.d.hidden_scales.shape = {2, 1}; },
                   "hidden_scales dimension 0 must be 3, got shape [2, 1]");
  expect_ref_error(
      [&](rf& f, rc& c) {
        fp8_input(f, c);
        c.d.hidden_scales.shape = {3, 2};
        c.d.hidden_scales.strides = {2, 1};
      },
      "hidden_scales dimension 1 must be 1, got shape [3, 2]");
  expect_ref_error([&](rf& f, rc& c) { fp8_input(f, c); c.out = f.out.view; },
                   "output must be bf16 to match hidden_states, got f32");
  // A bf16 output written over an fp8 input would run past the input's end.
  auto inplace = run_params;
  inplace.inplace = true;
  expect_ref_error(
      [&](rf& f, rc& c) {
        fp8_input(f, c);
        c.out.data = c.d.hidden_states.data;
      },
      "inplace needs hidden_states of the output's dtype, got f8_e4m3", inplace);
}

TEST_CASE("run rejects unquantized weights of the wrong shape, place or type") {
  expect_ref_error(
      [](rf&, rc& c) {
        c.q.w13.rank = 2;
        c.q.w13.shape = {4, 64};
        c.q.w13.strides = {64, 1};
      },
      "w13 must have rank 3, got shape [4, 64]");
  expect_ref_error([](rf&, rc& c) { c.q.w13.space = mr::memory_space::device; }, "w13 must live in host memory, got device");
  expect_ref_error([](rf&, rc& c) { c.q.w13.strides = {64, 1, 8}; }, "w13 must be contiguous (row-major)");
  expect_ref_error([](rf&, rc& c) { c.q.w13.data = nullptr; }, "w13 has a null data pointer");
  expect_ref_error([](rf&, rc& c) { c.q.w13.shape[0] = 3; }, "w13 dimension 0 must be 4, got shape [3, 8, 8]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.q.w13.shape = {4, 4, 8};
        c.q.w13.strides = {32, 8, 1};
      },
      "w13 dimension 1 must be 8, got shape [4, 4, 8]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.q.w13.shape = {4, 8, 4};
        c.q.w13.strides = {32, 4, 1};
      },
      "w13 dimension 2 must be 8, got shape [4, 8, 4]");
  expect_ref_error([](rf&, rc& c) { c.q.w2.shape[0] = 5; }, "w2 dimension 0 must be 4, got shape [5, 8, 4]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.q.w2.shape = {4, 4, 8};
        c.q.w2.strides = {32, 8, 1};
      },
      "w2 dimension 1 must be 8, got shape [4, 4, 8]");
  expect_ref_error(
      [](rf&, rc& c) {
        c.q.w2.shape = {4, 8, 5};
        c.q.w2.strides = {40, 5, 1};
      },
      "w2 dimension 2 must be 4, got shape [4, 8, 5]");
  expect_ref_error([](rf&, rc& c) { c.q.w2.data = nullptr; }, "w2 has a null data pointer");
  expect_ref_error([](rf&, rc& c) { c.q.w2.space = mr::memory_space::device; }, "w2 must live in host memory, got device");
  expect_ref_error([](rf&, rc& c) { c.q.w13.type = c.q.w2.type = mr::dtype::i32; },
                   "unquantized w13 must be f32, f16 or bf16, got i32");
  expect_ref_error([](rf&, rc& c) { c.q.w13.type = mr::dtype::f8_e4m3; },
                   "unquantized w13 must be f32, f16 or bf16, got f8_e4m3");
  expect_ref_error([](rf&, rc& c) { c.q.w2.type = mr::dtype::bf16; }, "w2 and w13 must have the same dtype");
  // Local experts decide the leading dimension.
  auto local = run_params;
  local.num_local_experts = 2;
  expect_ref_error([](rf&, rc&) {}, "w13 dimension 0 must be 2, got shape [4, 8, 8]", local);
  // Ungated weights hold I rows, not 2I.
  auto ungated = run_params;
  ungated.is_gated = false;
  expect_ref_error([](rf&, rc&) {}, "w13 dimension 1 must be 4, got shape [4, 8, 8]", ungated);
}

TEST_CASE("run takes optional biases b13 [E, 2I] and b2 [E, H] in f32 or the weights' dtype") {
  run_fixture f;
  mr::MoeRunner<mr::reference_policy> r("reference", mr::MoeRunnerConfig(run_params));
  run_call c = valid_call(f);
  c.q.b13 = f.b13.view;
  c.q.b2 = f.b2.view;
  CHECK_NOTHROW(r.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()));
  c.q.b13 = {};  // either alone
  CHECK_NOTHROW(r.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()));
  // A bias of the weights' 16-bit dtype beside an f32 one.
  host_tensor w13h(mr::dtype::f16, {4, 8, 8}), w2h(mr::dtype::f16, {4, 8, 4});
  const mr::unquantized_quant_info half{w13h.view, w2h.view, f.b13_f16.view, f.b2.view};
  CHECK_NOTHROW(r.run(c.d, half, c.out, c.ws, mr::cpu_test::host_stream()));
}

TEST_CASE("run rejects biases of the wrong shape, dtype, place or layout before anything runs") {
  const auto with_bias = [](rf& f, rc& c) {
    c.q.b13 = f.b13.view;
    c.q.b2 = f.b2.view;
  };
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b13.shape = {4, 4}; c.q.b13.strides = {4, 1}; },
                   "b13 dimension 1 must be 8, got shape [4, 4]");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b13.shape = {2, 16}; c.q.b13.strides = {16, 1}; },
                   "b13 dimension 0 must be 4, got shape [2, 16]");
  expect_ref_error(
      [&](rf& f, rc& c) {
        with_bias(f, c);
        c.q.b13.rank = 3;
        c.q.b13.shape = {4, 8, 1};
        c.q.b13.strides = {8, 1, 1};
      },
      "b13 must have rank 2, got shape [4, 8, 1]");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b2.shape = {4, 4}; c.q.b2.strides = {4, 1}; },
                   "b2 dimension 1 must be 8, got shape [4, 4]");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b13 = f.b13_f16.view; },
                   "b13 must be f32 or f32 (the weights' dtype), got f16");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b2 = f.b2_bf16.view; },
                   "b2 must be f32 or f32 (the weights' dtype), got bf16");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b2.type = mr::dtype::i32; },
                   "b2 must be f32 or f32 (the weights' dtype), got i32");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b13.space = mr::memory_space::device; },
                   "b13 must live in host memory, got device");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b2.strides = {1, 4}; }, "b2 must be contiguous (row-major)");
  expect_ref_error([&](rf& f, rc& c) { with_bias(f, c); c.q.b13.data = nullptr; }, "b13 has a null data pointer");
  expect_ref_error(
      [&](rf& f, rc& c) {
        with_bias(f, c);
        c.q.b2.data = static_cast<char*>(c.q.b2.data) + 2;
      },
      "b2 must be 4-byte aligned (its f32 elements are read in place)");
  // An ungated w13 has I rows, and b13 with it.
  auto ungated = run_params;
  ungated.is_gated = false;
  expect_ref_error(
      [&](rf& f, rc& c) {
        c.q.w13.shape = {4, 4, 8};
        c.q.w13.strides = {32, 8, 1};
        with_bias(f, c);
      },
      "b13 dimension 1 must be 4, got shape [4, 8]", ungated);
}

TEST_CASE("run rejects fp8 weights or scales of the wrong shape or type") {
  const auto fp8 = [](rc& c) { c.fp8 = true; };
  expect_ref_error([&](rf& f, rc& c) { fp8(c); c.q8.w13 = f.w13.view; }, "w13 must be f8_e4m3, got f32");
  expect_ref_error([&](rf& f, rc& c) { fp8(c); c.q8.w2 = f.w2.view; }, "w2 must be f8_e4m3, got f32");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w13.shape[0] = 3; }, "w13 dimension 0 must be 4, got shape [3, 8, 8]");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w13_scale = {}; }, "w13_scale must have rank 3, got shape []");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w13_scale.shape = {4, 2, 1}; c.q8.w13_scale.strides = {2, 1, 1}; },
                   "w13_scale dimension 1 must be 1, got shape [4, 2, 1]");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w2_scale.shape = {4, 1, 2}; c.q8.w2_scale.strides = {2, 2, 1}; },
                   "w2_scale dimension 2 must be 1, got shape [4, 1, 2]");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w2_scale.type = mr::dtype::bf16; }, "w2_scale must be f32, got bf16");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w13_scale.type = mr::dtype::f16; }, "w13_scale must be f32, got f16");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w2_scale.data = nullptr; }, "w2_scale has a null data pointer");
  expect_ref_error([&](rf&, rc& c) { fp8(c); c.q8.w13_scale.space = mr::memory_space::device; },
                   "w13_scale must live in host memory, got device");
}

TEST_CASE("per-tensor and per-channel fp8 scales: valid calls run, scales of another shape are rejected") {
  run_fixture f;
  const run_call c = valid_call(f);
  host_tensor t13{mr::dtype::f32, {4}}, t2{mr::dtype::f32, {4}};
  host_tensor c13{mr::dtype::f32, {4, 8}}, c2{mr::dtype::f32, {4, 8}}, c13_short{mr::dtype::f32, {4, 4}};
  std::mt19937 rng(5);
  for (host_tensor* t : {&t13, &t2, &c13, &c2, &c13_short}) mr::cpu_test::fill_uniform(*t, rng, 0.1f, 1.0f);
  mr::MoeRunner<mr::reference_policy> r("reference", mr::MoeRunnerConfig(run_params));
  const auto run = [&](const auto& q) {
    mr::cpu_test::fill_sentinel(f.out);
    const auto before = f.out.bytes();
    try {
      r.run(c.d, q, c.out, c.ws, mr::cpu_test::host_stream());
    } catch (...) {
      CHECK(f.out.bytes() == before);  // nothing written
      throw;
    }
  };
  using tensor_q = mr::fp8_tensor_quant_info;
  using channel_q = mr::fp8_channel_quant_info;
  CHECK_NOTHROW(run(tensor_q{f.q13.view, t13.view, f.q2.view, t2.view}));
  CHECK_NOTHROW(run(channel_q{f.q13.view, c13.view, f.q2.view, c2.view}));
  CHECK_THROWS_WITH_AS(run(tensor_q{f.q13.view, c13.view, f.q2.view, t2.view}),
                       "MoeRunner::run: w13_scale must have rank 1, got shape [4, 8]", mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(run(tensor_q{f.q13.view, t13.view, f.q2.view, f.s2.view}),
                       "MoeRunner::run: w2_scale must have rank 1, got shape [4, 1, 1]", mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(run(channel_q{f.q13.view, c13_short.view, f.q2.view, c2.view}),
                       "MoeRunner::run: w13_scale dimension 1 must be 8, got shape [4, 4]", mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(run(channel_q{f.q13.view, c13.view, f.q2.view, t2.view}),
                       "MoeRunner::run: w2_scale must have rank 2, got shape [4]", mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(run(channel_q{f.q13.view, c13.view, f.w2.view, c2.view}),
                       "MoeRunner::run: w2 must be f8_e4m3, got f32", mr::invalid_argument_error);
  mr::tensor_view bf16_scale = t2.view;
  bf16_scale.type = mr::dtype::bf16;
  CHECK_THROWS_WITH_AS(run(tensor_q{f.q13.view, t13.view, f.q2.view, bf16_scale}),
                       "MoeRunner::run: w2_scale must be f32, got bf16", mr::invalid_argument_error);
}

TEST_CASE("run rejects a workspace that is too small or missing") {
  const auto needs = [](const std::function<void(rf&, rc&)>& m, const std::string& what) {
    expect_run_error<mr::invalid_argument_error, mr::reference_policy, needs_workspace>(
        "needs_workspace", run_params, m, "MoeRunner::run: " + what);
  };
  mr::backend_registry::global().add<needs_workspace>({__FILE__, __LINE__}, mr::registration_kind::new_backend);
  needs([](rf&, rc& c) { c.ws.bytes = 10; }, "workspace too small: 10 bytes given, 192 needed (ask workspace_bytes)");
  needs([](rf&, rc& c) { c.ws = {}; }, "workspace too small: 0 bytes given, 192 needed (ask workspace_bytes)");
  needs([](rf&, rc& c) { c.ws.data = nullptr; }, "workspace has a null data pointer");
  // Exactly enough is enough, and the policy gets the caller's memory.
  run_fixture f;
  run_call c = valid_call(f);
  c.ws.bytes = 192;
  mr::MoeRunner<mr::reference_policy, needs_workspace> r("needs_workspace", mr::MoeRunnerConfig(run_params));
  CHECK(r.workspace_bytes(3) == 192);
  CHECK_NOTHROW(r.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()));
  CHECK(needs_workspace::stats().last_workspace == f.ws.data());
}

TEST_CASE("run rejects out-of-range expert ids of a host backend before writing") {
  const auto ids_error = [](int slot, int id, const std::string& what, mr::moe_config_params params = run_params) {
    expect_run_error<mr::invalid_argument_error, mr::reference_policy>(
        "reference", params, [=](rf& f, rc&) { f.ids.ptr<std::int32_t>()[slot] = id; }, "MoeRunner::run: " + what);
  };
  ids_error(2, 4, "topk_ids[1, 0] = 4 is outside [-1, num_local_experts=4)");
  ids_error(5, -2, "topk_ids[2, 1] = -2 is outside [-1, num_local_experts=4)");
  ids_error(0, 1 << 30, "topk_ids[0, 0] = 1073741824 is outside [-1, num_local_experts=4)");
  // With fewer local experts, the bound is the local count (and the weights hold only those).
  auto local = run_params;
  local.num_local_experts = 2;
  expect_run_error<mr::invalid_argument_error, mr::reference_policy>(
      "reference", local,
      [](rf& f, rc& c) {
        c.q.w13.shape[0] = c.q.w2.shape[0] = 2;
        for (int i = 0; i < 6; ++i) f.ids.ptr<std::int32_t>()[i] = i % 2;
        f.ids.ptr<std::int32_t>()[3] = 2;
      },
      "MoeRunner::run: topk_ids[1, 1] = 2 is outside [-1, num_local_experts=2)");
  // The same ids are fine once in range, -1 included.
  run_fixture f;
  run_call c = valid_call(f);
  f.ids.ptr<std::int32_t>()[2] = -1;
  mr::MoeRunner<mr::reference_policy> r("reference", mr::MoeRunnerConfig(run_params));
  CHECK_NOTHROW(r.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()));
  // The reference policy checks again when it is run without a runner.
  f.ids.ptr<std::int32_t>()[5] = 7;
  const mr::reference_policy direct{mr::MoeRunnerConfig(run_params)};
  CHECK_THROWS_WITH_AS(direct.run_from_dispatch(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()),
                       "reference_policy: topk_ids[2, 1] = 7 is outside [-1, num_local_experts=4)",
                       mr::invalid_argument_error);
}

namespace {

// A host backend written from the README alone: it indexes a per-expert table by id with no
// check of its own, and records every id it is handed.
class table_policy {
 public:
  static constexpr std::string_view name = "table_policy";
  static constexpr mr::memory_space tensor_space = mr::memory_space::host;
  using quant_infos = mr::quant_info_list<mr::unquantized_quant_info>;

  static std::vector<std::int32_t>& seen() {
    static std::vector<std::int32_t> ids;
    return ids;
  }

  explicit table_policy(const mr::MoeRunnerConfig& cfg) : table_(static_cast<std::size_t>(cfg.num_local_experts()), 1.0f) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  mr::CombineInput run_from_dispatch(const mr::DispatchOutput& d, const mr::unquantized_quant_info&,
                                     const mr::tensor_view& out, mr::workspace_view, cuda::stream_ref) {
    const auto* ids = d.topk.topk_ids.ptr<const std::int32_t>();
    float sum = 0.0f;
    for (std::int64_t i = 0; i < d.topk.topk_ids.numel(); ++i) {
      seen().push_back(ids[i]);
      if (ids[i] >= 0) sum += table_.data()[ids[i]];  // out of bounds for a bad id
    }
    for (std::int64_t i = 0; i < out.numel(); ++i) out.ptr<float>()[i] = sum;
    return {out, true};
  }

 private:
  std::vector<float> table_;
};
static_assert(mr::explain_dispatch_runner_core<table_policy>());

}  // namespace

TEST_CASE("a custom host backend never sees an out-of-range id") {
  mr::backend_registry registry;
  registry.add<table_policy>({__FILE__, __LINE__}, mr::registration_kind::new_backend);
  mr::MoeRunner<table_policy> runner("table_policy", mr::MoeRunnerConfig(run_params), registry);
  run_fixture f;
  run_call c = valid_call(f);
  for (const std::int32_t bad : {1000, 4, -2, std::numeric_limits<std::int32_t>::min()}) {
    CAPTURE(bad);
    table_policy::seen().clear();
    f.ids.ptr<std::int32_t>()[3] = bad;
    CHECK_THROWS_WITH_AS(runner.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()),
                         ("MoeRunner::run: topk_ids[1, 1] = " + std::to_string(bad) +
                          " is outside [-1, num_local_experts=4)")
                             .c_str(),
                         mr::invalid_argument_error);
    CHECK(table_policy::seen().empty());
  }
  // In range (and -1), the policy runs and sees exactly the ids it was given.
  f.ids.ptr<std::int32_t>()[3] = -1;
  CHECK_NOTHROW(runner.run(c.d, c.q, c.out, c.ws, mr::cpu_test::host_stream()));
  REQUIRE(table_policy::seen().size() == 6);
  for (std::int32_t id : table_policy::seen()) CHECK((id >= -1 && id < 4));
}

TEST_CASE("run refuses quant info the chosen backend does not consume, and LoRA hooks it cannot use") {
  mr::backend_registry::global().add<unquant_only>({__FILE__, __LINE__}, mr::registration_kind::new_backend);
  expect_run_error<mr::unsupported_error, mr::reference_policy, unquant_only>(
      "unquant_only", run_params, [](rf&, rc& c) { c.fp8 = true; },
      "backend 'unquant_only' does not consume quant info 'fp8_e4m3_block128'");
  const mr::lora_hooks hooks{mr::builtin::reference, {}};
  expect_run_error<mr::unsupported_error, mr::reference_policy>(
      "reference", run_params, [&](rf&, rc& c) { c.lora = &hooks; },
      "LoRA hooks were passed but backend 'reference' is not LoRA-capable");
  // Validation comes first: a bad call with hooks reports the bad argument.
  expect_run_error<mr::invalid_argument_error, mr::reference_policy>(
      "reference", run_params,
      [&](rf&, rc& c) {
        c.lora = &hooks;
        c.out.data = nullptr;
      },
      "MoeRunner::run: output has a null data pointer");
}

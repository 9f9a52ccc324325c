// The reference backend against a naive f64 loop written here from the definitions
// (DESIGN.md §1, quant/quant_info.hpp), on fresh random inputs of many shapes.
// Nothing of the reference's own helpers is used: weights and activations are decoded,
// activated and fp8-quantized by this file's code.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::decode;
using mr::cpu_test::host_tensor;

namespace {

// ---- fp8 e4m3, from the format definition --------------------------------------------

// The 127 non-negative finite e4m3 values in code order (which is also value order).
const std::array<double, 127>& e4m3_values() {
  static const std::array<double, 127> v = [] {
    std::array<double, 127> a{};
    for (int c = 0; c < 127; ++c) a[c] = mr::cpu_test::decode_e4m3(static_cast<std::uint8_t>(c));
    return a;
  }();
  return v;
}

// Rounds to the nearest e4m3 value, ties to the even code, saturating at 448.
double round_to_e4m3(double x) {
  const auto& v = e4m3_values();
  const double a = std::fabs(x);
  if (a >= v[126]) return std::copysign(v[126], x);
  const auto hi = std::upper_bound(v.begin(), v.end(), a);
  const int c = static_cast<int>(hi - v.begin());  // v[c-1] <= a < v[c]
  const double below = v[c - 1], above = v[c];
  double r;
  if (a - below < above - a) r = below;
  else if (a - below > above - a) r = above;
  else r = ((c - 1) % 2 == 0) ? below : above;
  return std::copysign(r, x);
}

// Per-group fp8 quantization of an activation vector: scale = amax/448 (an f32, at least 2^-126),
// each value as an f32 times the f32 reciprocal of the scale, rounded to e4m3, multiplied back.
void quantize_groups(std::vector<double>& v) {
  for (std::size_t g = 0; g < v.size(); g += 128) {
    const std::size_t end = std::min(v.size(), g + 128);
    double amax = 0.0;
    for (std::size_t i = g; i < end; ++i) amax = std::max(amax, std::fabs(v[i]));
    if (amax == 0.0) continue;
    const float scale = std::max(static_cast<float>(amax / 448.0), 0x1p-126f);
    const float inverse = 1.0f / scale;
    for (std::size_t i = g; i < end; ++i) v[i] = round_to_e4m3(static_cast<float>(v[i]) * inverse) * scale;
  }
}

// ---- activations, from the definitions -----------------------------------------------

double naive_activation(const mr::activation& a, bool gated, double gate, double up) {
  const auto sig = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  switch (a.kind) {
    case mr::activation_kind::silu: return gate * sig(gate) * (gated ? up : 1.0);
    case mr::activation_kind::gelu: return 0.5 * gate * (1.0 + std::erf(gate / std::sqrt(2.0))) * (gated ? up : 1.0);
    case mr::activation_kind::swiglu_clamped: {
      const double g = std::min<double>(gate, a.limit);
      const double u = std::max<double>(std::min<double>(up, a.limit), -a.limit);
      return (u + 1.0) * g * sig(a.alpha * g);
    }
  }
  return NAN;
}

// ---- one problem -----------------------------------------------------------------------

struct problem_spec {
  int m = 7, e = 4, local = 0, k = 2, h = 24, inter = 40;
  mr::dtype x_type = mr::dtype::f32;
  mr::dtype w_type = mr::dtype::f32;  // ignored when fp8
  mr::activation act{};
  bool gated = true;
  bool router_on_input = false;
  bool no_combine = false;
  bool inplace = false;
  float routed_scaling = 1.0f;
  bool scaling_applied = false;
  double filtered = 0.0;  // probability of a -1 slot
  bool fp8 = false;
  mr::fp8_weight_scaling scaling = mr::fp8_weight_scaling::block128;  // of fp8 weights
  bool fp8_input = false;  // hidden states arrive as e4m3 with per-token group scales
  float x_range = 1.0f;
  enum class ids_kind { random, one_expert } ids = ids_kind::random;
  bool interleaved = false;  // gate_up_layout: row 2j gate j, 2j + 1 up j
  bool bias = false;         // b13 and b2 (unquantized only)
  mr::dtype bias_type = mr::dtype::f32;

  std::string str() const {
    return "M=" + std::to_string(m) + " E=" + std::to_string(e) + " local=" + std::to_string(local) +
           " k=" + std::to_string(k) + " H=" + std::to_string(h) + " I=" + std::to_string(inter) + " x=" +
           std::string(mr::dtype_name(x_type)) +
           " w=" + (fp8 ? std::string(scaling_name()) : std::string(mr::dtype_name(w_type))) +
           " act=" + std::string(mr::activation_name(act.kind)) + (gated ? "" : " ungated") +
           (router_on_input ? " weight-on-input" : "") + (no_combine ? " no_combine" : "") +
           (inplace ? " inplace" : "") + " rsf=" + std::to_string(routed_scaling) +
           (scaling_applied ? " applied" : "") + " filtered=" + std::to_string(filtered) +
           (fp8_input ? " fp8-input" : "") + (interleaved ? " interleaved" : "") +
           (bias ? " bias=" + std::string(mr::dtype_name(bias_type)) : "");
  }
  std::string_view scaling_name() const {
    switch (scaling) {
      case mr::fp8_weight_scaling::per_tensor: return "fp8/tensor";
      case mr::fp8_weight_scaling::per_channel: return "fp8/channel";
      case mr::fp8_weight_scaling::block128: break;
    }
    return "fp8/block";
  }
};

int blocks(int n) { return (n + 127) / 128; }

struct problem {
  problem_spec s;
  mr::MoeRunnerConfig cfg;
  host_tensor x, x_scales, w13, w2, s13, s2, b13, b2, weights, ids, out;

  static mr::MoeRunnerConfig make_config(const problem_spec& s) {
    return mr::MoeRunnerConfig({.num_experts = s.e,
                                .num_local_experts = s.local,
                                .hidden_size = s.h,
                                .intermediate_size = s.inter,
                                .top_k = s.k,
                                .act = s.act,
                                .is_gated = s.gated,
                                .gate_up_layout = s.interleaved ? mr::w13_layout::interleaved : mr::w13_layout::halves,
                                .apply_router_weight_on_input = s.router_on_input,
                                .routed_scaling_factor = s.routed_scaling,
                                .no_combine = s.no_combine,
                                .inplace = s.inplace});
  }

  problem(const problem_spec& spec, std::mt19937& rng) : s(spec), cfg(make_config(spec)) {
    const int le = cfg.num_local_experts(), rows = cfg.w13_rows();
    std::uniform_real_distribution<float> ux(-s.x_range, s.x_range);
    if (s.fp8_input) {
      // Quantize random values per token and 128-column group: that is what arrives.
      host_tensor x32(mr::dtype::f32, {s.m, s.h});
      for (std::int64_t i = 0; i < x32.numel(); ++i) x32.ptr<float>()[i] = ux(rng);
      mr::test::quantize_e4m3_blocks(x32, 1, x, x_scales);
    } else {
      x = host_tensor(s.x_type, {s.m, s.h});
      mr::cpu_test::fill_uniform(x, rng, -s.x_range, s.x_range);
    }
    // Weight ranges that keep every intermediate and output value of order one.
    const float a13 = 2.0f / std::sqrt(float(s.h)), a2 = 2.0f / std::sqrt(float(s.inter));
    if (s.fp8) {
      make_fp8(w13, s13, {le, rows, s.h}, a13, s.scaling, rng);
      make_fp8(w2, s2, {le, s.h, s.inter}, a2, s.scaling, rng);
    } else {
      w13 = host_tensor(s.w_type, {le, rows, s.h});
      w2 = host_tensor(s.w_type, {le, s.h, s.inter});
      mr::cpu_test::fill_uniform(w13, rng, -a13, a13);
      mr::cpu_test::fill_uniform(w2, rng, -a2, a2);
    }
    if (s.bias) {
      b13 = host_tensor(s.bias_type, {le, rows});
      b2 = host_tensor(s.bias_type, {le, s.h});
      mr::cpu_test::fill_uniform(b13, rng, -1.0f, 1.0f);
      mr::cpu_test::fill_uniform(b2, rng, -1.0f, 1.0f);
    }
    weights = host_tensor(mr::dtype::f32, {s.m, s.k});
    ids = host_tensor(mr::dtype::i32, {s.m, s.k});
    std::uniform_real_distribution<float> uw(0.05f, 1.0f), coin(0.0f, 1.0f);
    std::vector<int> perm(le);
    for (int t = 0; t < s.m; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < s.k; ++j) {
        int id = s.ids == problem_spec::ids_kind::one_expert ? (j == 0 ? le - 1 : -1) : perm[j % le];
        if (coin(rng) < s.filtered) id = -1;
        ids.ptr<std::int32_t>()[t * s.k + j] = id;
        weights.ptr<float>()[t * s.k + j] = uw(rng);
      }
    }
    if (s.inplace) {
      out = x;  // a separate copy would not alias; the run gets x's own view below
    } else {
      const mr::dtype out_type = s.fp8_input ? mr::dtype::bf16 : s.x_type;
      out = s.no_combine ? host_tensor(out_type, {s.m, s.k, s.h}) : host_tensor(out_type, {s.m, s.h});
      mr::cpu_test::fill_sentinel(out);
    }
  }

  // Random f32 weights, quantized with scale amax/448 per 128x128 block, row or matrix.
  static void make_fp8(host_tensor& w, host_tensor& scale, std::initializer_list<std::int64_t> dims, float range,
                       mr::fp8_weight_scaling scaling, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-range, range);
    host_tensor master(mr::dtype::f32, dims);
    for (std::int64_t i = 0; i < master.numel(); ++i) master.ptr<float>()[i] = u(rng);
    if (scaling == mr::fp8_weight_scaling::block128) mr::test::quantize_e4m3_blocks(master, 128, w, scale);
    else mr::test::quantize_e4m3_rows(master, scaling == mr::fp8_weight_scaling::per_tensor, w, scale);
  }

  // The scale of weight (r, c) of expert ex's [rows, cols] matrix.
  double weight_scale(const host_tensor& scale, int ex, int r, int c, int rows, int cols) const {
    const float* sp = scale.ptr<const float>();
    switch (s.scaling) {
      case mr::fp8_weight_scaling::per_tensor: return sp[ex];
      case mr::fp8_weight_scaling::per_channel: return sp[std::int64_t(ex) * rows + r];
      case mr::fp8_weight_scaling::block128: break;
    }
    return sp[(std::int64_t(ex) * blocks(rows) + r / 128) * blocks(cols) + c / 128];
  }

  // The expected output in double, and per element the sum of |contributions| (for the bound).
  void naive(std::vector<double>& want, std::vector<double>& mag) const {
    const int k = s.k, h = s.h, inter = s.inter, rows = cfg.w13_rows();
    const std::size_t n = static_cast<std::size_t>(s.m) * (s.no_combine ? k : 1) * h;
    want.assign(n, 0.0);
    mag.assign(n, 0.0);
    const auto w13v = [&](int ex, int r, int c) {
      double v = decode(w13.view, (std::int64_t(ex) * rows + r) * h + c);
      if (s.fp8) v *= weight_scale(s13, ex, r, c, rows, h);
      return v;
    };
    const auto w2v = [&](int ex, int r, int i) {
      double v = decode(w2.view, (std::int64_t(ex) * h + r) * inter + i);
      if (s.fp8) v *= weight_scale(s2, ex, r, i, h, inter);
      return v;
    };
    const double scaling = s.scaling_applied ? 1.0 : double(s.routed_scaling);
    for (int t = 0; t < s.m; ++t) {
      std::vector<double> xrow(h);
      for (int c = 0; c < h; ++c) {
        xrow[c] = decode(x.view, std::int64_t(t) * h + c);
        if (s.fp8_input) xrow[c] *= x_scales.ptr<const float>()[t * blocks(h) + c / 128];
      }
      for (int j = 0; j < k; ++j) {
        const int ex = ids.ptr<const std::int32_t>()[t * k + j];
        if (ex < 0) continue;
        const double w = weights.ptr<const float>()[t * k + j];
        // fp8: the row is quantized as it is, and a router weight on the input scales the sums.
        std::vector<double> xin = xrow;
        if (s.fp8 && !s.fp8_input) quantize_groups(xin);
        const double sum_scale = s.fp8 && s.router_on_input ? w : 1.0;
        if (s.router_on_input && !s.fp8)
          for (double& v : xin) v *= w;
        std::vector<double> act(inter);
        const auto bias = [&](const host_tensor& b, int col) {
          return s.bias ? decode(b.view, std::int64_t(ex) * b.view.shape[1] + col) : 0.0;
        };
        for (int i = 0; i < inter; ++i) {
          const int gate_row = s.interleaved ? 2 * i : i, up_row = s.interleaved ? 2 * i + 1 : inter + i;
          double gate = 0.0, up = 0.0;
          for (int c = 0; c < h; ++c) gate += w13v(ex, gate_row, c) * xin[c];
          gate = gate * sum_scale + bias(b13, gate_row);
          if (s.gated) {
            for (int c = 0; c < h; ++c) up += w13v(ex, up_row, c) * xin[c];
            up = up * sum_scale + bias(b13, up_row);
          }
          act[i] = naive_activation(s.act, s.gated, gate, up);
        }
        if (s.fp8) quantize_groups(act);
        const double row_scale = (s.router_on_input ? 1.0 : w) * scaling;
        const std::size_t base = static_cast<std::size_t>(s.no_combine ? t * k + j : t) * h;
        for (int r = 0; r < h; ++r) {
          double y = bias(b2, r);
          for (int i = 0; i < inter; ++i) y += w2v(ex, r, i) * act[i];
          want[base + r] += y * row_scale;
          mag[base + r] += std::fabs(y * row_scale);
        }
      }
    }
  }

  mr::DispatchOutput dispatch() const {
    return {x.view, s.fp8_input ? x_scales.view : mr::tensor_view{}, {weights.view, ids.view, s.scaling_applied}};
  }
};

// Half an ulp of the output type, relative: the rounding of the final store.
double output_rtol(mr::dtype t) {
  switch (t) {
    case mr::dtype::bf16: return std::ldexp(1.0, -8);
    case mr::dtype::f16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}

// Runs the reference through a runner and compares every output element with the naive loop.
void check_problem(const problem_spec& spec, std::mt19937& rng) {
  CAPTURE(spec.str());
  problem p(spec, rng);
  std::vector<double> want, mag;
  p.naive(want, mag);  // before the run: inplace overwrites x

  mr::MoeRunner<mr::reference_policy> runner("reference", p.cfg);
  const mr::tensor_view out_view = spec.inplace ? p.x.view : p.out.view;
  const mr::DispatchOutput d = p.dispatch();
  mr::CombineInput ci;
  const auto run_fp8 = [&]<class Q>(std::type_identity<Q>) {
    return runner.run(d, Q{p.w13.view, p.s13.view, p.w2.view, p.s2.view}, out_view, {}, mr::cpu_test::host_stream());
  };
  if (spec.fp8 && spec.scaling == mr::fp8_weight_scaling::per_tensor)
    ci = run_fp8(std::type_identity<mr::fp8_tensor_quant_info>{});
  else if (spec.fp8 && spec.scaling == mr::fp8_weight_scaling::per_channel)
    ci = run_fp8(std::type_identity<mr::fp8_channel_quant_info>{});
  else if (spec.fp8)
    ci = run_fp8(std::type_identity<mr::fp8_block_quant_info>{});
  else
    ci = runner.run(d, mr::unquantized_quant_info{p.w13.view, p.w2.view, p.b13.view, p.b2.view}, out_view, {},
                    mr::cpu_test::host_stream());
  CHECK(ci.hidden_states.data == out_view.data);
  CHECK(ci.combined == !spec.no_combine);
  REQUIRE(static_cast<std::size_t>(out_view.numel()) == want.size());

  const double rtol = output_rtol(out_view.type);
  const double atol = out_view.type == mr::dtype::f16 ? std::ldexp(1.0, -25) : 0.0;
  int bad = 0;
  double max_abs = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double got = decode(out_view, static_cast<std::int64_t>(i));
    const double bound = rtol * std::fabs(want[i]) + 1e-12 * mag[i] + atol;
    max_abs = std::max(max_abs, std::fabs(want[i]));
    if (!(std::fabs(got - want[i]) <= bound)) {
      if (++bad <= 5)
        MESSAGE("element " << i << ": got " << got << ", want " << want[i] << " (bound " << bound << ")");
    }
  }
  CHECK(bad == 0);
  // The data is not degenerate: where some slot was routed, some output is visible.
  const auto* id = p.ids.ptr<const std::int32_t>();
  if (std::any_of(id, id + p.ids.numel(), [](std::int32_t v) { return v >= 0; })) CHECK(max_abs > 1e-3);
}

constexpr mr::dtype float_types[] = {mr::dtype::f32, mr::dtype::bf16, mr::dtype::f16};
constexpr mr::activation_kind act_kinds[] = {mr::activation_kind::silu, mr::activation_kind::gelu,
                                             mr::activation_kind::swiglu_clamped};
constexpr int odd_sizes[] = {24, 40, 72};

}  // namespace

TEST_CASE("fp8 rounding written here agrees with the format on every code") {
  // Each value rounds to itself; midpoints round to the even code; beyond 448 saturates.
  const auto& v = e4m3_values();
  for (int c = 0; c < 127; ++c) {
    CHECK(round_to_e4m3(v[c]) == v[c]);
    CHECK(round_to_e4m3(-v[c]) == -v[c]);
    if (c < 126) {
      const double mid = 0.5 * (v[c] + v[c + 1]);
      CHECK(round_to_e4m3(mid) == (c % 2 == 0 ? v[c] : v[c + 1]));
    }
  }
  CHECK(round_to_e4m3(1e9) == 448.0);
  CHECK(round_to_e4m3(-500.0) == -448.0);
  CHECK(v[126] == 448.0);
  CHECK(v[1] == std::ldexp(1.0, -9));
}

TEST_CASE("fp8 groups of tiny values: the scale floor keeps zeros zero and nothing NaN") {
  // amax / 448 below 2^-126 (down to where it would round to 0 in f32 and 0 / 0 gave NaN): the
  // scale is 2^-126, so 1 / scale is finite. The reference's rule and the one written here agree
  // value for value, on tiny groups and on a normal one beside them.
  std::vector<double> v(4 * 128, 0.0);
  for (int i = 1; i < 128; i += 2) v[i] = std::ldexp(static_cast<double>(i), -160);        // f32 subnormals
  for (int i = 128; i < 256; i += 3) v[i] = std::ldexp(-static_cast<double>(i), -140);    // amax / 448 ~ 2^-141
  for (int i = 256; i < 384; ++i) v[i] = std::ldexp(1.0 + i % 7, -130);                    // amax / 448 ~ 2^-136
  for (int i = 384; i < 512; ++i) v[i] = 0.01 * (i - 448);                                  // normal
  std::vector<double> got = v, want = v;
  mr::reference::fp8_group_roundtrip(got);
  quantize_groups(want);
  for (std::size_t i = 0; i < v.size(); ++i) {
    CAPTURE(i);
    CHECK(std::isfinite(got[i]));
    CHECK(got[i] == want[i]);
    if (v[i] == 0.0) CHECK(got[i] == 0.0);
  }
  // 2^-130 over a group whose amax is 7 * 2^-130: times 2^126 it is 2^-4, an e4m3 value, so it
  // comes back exactly.
  CHECK(got[259] == std::ldexp(1.0, -130));  // 259 % 7 == 0
}

TEST_CASE("the host conversions the inputs are built with are exact") {
  // Every bf16 and f16 code decodes to the value its bits define, and encodes back.
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto u = static_cast<std::uint16_t>(b);
    const double bv = mr::cpu_test::decode_bf16(u), hv = mr::cpu_test::decode_f16(u);
    if (!std::isnan(bv)) {
      REQUIRE(mr::host_float::bf16_to_float(u) == bv);
      REQUIRE(mr::host_float::float_to_bf16(static_cast<float>(bv)) == u);
    } else {
      REQUIRE(std::isnan(mr::host_float::bf16_to_float(u)));
    }
    if (!std::isnan(hv)) {
      REQUIRE(mr::host_float::half_to_float(u) == hv);
      REQUIRE(mr::host_float::float_to_half(static_cast<float>(hv)) == u);
    } else {
      REQUIRE(std::isnan(mr::host_float::half_to_float(u)));
    }
  }
  for (int c = 0; c < 256; ++c) {
    const auto q = static_cast<std::uint8_t>(c);
    const double v = mr::cpu_test::decode_e4m3(q);
    // The reference decodes weight rows through the table: the same bits as the function.
    CHECK(std::bit_cast<std::uint32_t>(mr::host_float::e4m3_table()[c]) ==
          std::bit_cast<std::uint32_t>(mr::host_float::e4m3_to_float(q)));
    if (std::isnan(v)) {
      CHECK(std::isnan(mr::host_float::e4m3_to_float(q)));
    } else {
      CHECK(mr::host_float::e4m3_to_float(q) == v);
      if (c != 0x80) CHECK(mr::host_float::float_to_e4m3(static_cast<float>(v)) == q);
    }
  }
  // Rounding of values between codes agrees with the nearest-value search.
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> u(-500.0f, 500.0f);
  std::uniform_int_distribution<int> ex(-12, 9);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::ldexp(u(rng) / 500.0f, ex(rng));
    CHECK(mr::cpu_test::decode_e4m3(mr::host_float::float_to_e4m3(x)) == round_to_e4m3(x));
    const float y = u(rng) * 1000.0f;
    CHECK(mr::cpu_test::decode_bf16(mr::host_float::float_to_bf16(y)) ==
          static_cast<double>(static_cast<float>(std::nearbyint(std::ldexp(double(y), -int(std::ilogb(y)) + 7)) *
                                                  std::ldexp(1.0, int(std::ilogb(y)) - 7))));
  }
}

TEST_CASE("a run of elements decodes as each element does, in every dtype") {
  // load_run_as_float (the reference's weight rows) against load_as_float, on random bits.
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> byte(0, 255);
  for (mr::dtype t : {mr::dtype::f32, mr::dtype::bf16, mr::dtype::f16, mr::dtype::f8_e4m3, mr::dtype::i32}) {
    CAPTURE(std::string(mr::dtype_name(t)));
    std::vector<unsigned char> bytes(64 * mr::dtype_size(t));
    for (unsigned char& b : bytes) b = static_cast<unsigned char>(byte(rng));
    const mr::tensor_view v = mr::tensor_view::contiguous(bytes.data(), t, {64}, mr::memory_space::host);
    std::vector<float> run(40);
    mr::reference::detail::load_run_as_float(v, 7, 40, run.data());
    for (int i = 0; i < 40; ++i) {
      const float one = mr::reference::detail::load_as_float(v, 7 + i);
      CHECK((std::bit_cast<std::uint32_t>(run[i]) == std::bit_cast<std::uint32_t>(one) ||
             (std::isnan(run[i]) && std::isnan(one))));
    }
  }
}

TEST_CASE("reference matches the naive loop over M, E, k, H, I, weight dtypes and activations") {
  std::mt19937 rng(20240601);
  int n = 0;
  for (int m : {0, 1, 7, 33})
    for (int e : {1, 4, 16})
      for (int k : {1, 2, 4}) {
        if (k > e) continue;
        for (mr::dtype wt : float_types)
          for (mr::activation_kind ak : act_kinds) {
            problem_spec s;
            s.m = m;
            s.e = e;
            s.k = k;
            s.h = odd_sizes[n % 3];
            s.inter = odd_sizes[(n / 3 + 1) % 3];
            s.x_type = float_types[(n / 2) % 3];
            s.w_type = wt;
            s.act.kind = ak;
            s.filtered = (n % 4 == 0) ? 0.25 : 0.0;
            ++n;
            check_problem(s, rng);
          }
      }
  CHECK(n == 4 * 7 * 9);
}

TEST_CASE("each activation, gated and not, in every weight dtype") {
  std::mt19937 rng(42);
  for (mr::dtype wt : float_types)
    for (mr::activation_kind ak : act_kinds)
      for (bool gated : {true, false}) {
        if (!gated && ak == mr::activation_kind::swiglu_clamped) continue;  // the config rejects it
        problem_spec s{.m = 33, .e = 16, .k = 4, .h = 40, .inter = 72, .x_type = wt, .w_type = wt};
        s.act.kind = ak;
        s.gated = gated;
        check_problem(s, rng);
      }
}

TEST_CASE("clamped swiglu with its own alpha and limit, on inputs that reach the clamps") {
  std::mt19937 rng(43);
  for (float limit : {0.5f, 7.0f}) {
    problem_spec s{.m = 33, .e = 4, .k = 2, .h = 72, .inter = 24, .x_range = 8.0f};
    s.act = {mr::activation_kind::swiglu_clamped, 1.2f, limit};
    check_problem(s, rng);
  }
}

TEST_CASE("router weight on the input (top_k = 1)") {
  std::mt19937 rng(44);
  for (mr::dtype xt : float_types)
    for (int e : {1, 4, 16}) {
      problem_spec s{.m = 33, .e = e, .k = 1, .h = 24, .inter = 72, .x_type = xt, .w_type = mr::dtype::bf16,
                     .router_on_input = true, .filtered = 0.2};
      check_problem(s, rng);
    }
}

TEST_CASE("no_combine leaves each slot's row, zero for filtered slots") {
  std::mt19937 rng(45);
  for (int k : {1, 2, 4})
    for (mr::dtype xt : float_types) {
      problem_spec s{.m = 7, .e = 16, .k = k, .h = 40, .inter = 24, .x_type = xt, .w_type = mr::dtype::f16,
                     .no_combine = true, .filtered = 0.3};
      check_problem(s, rng);
    }
}

TEST_CASE("routed scaling is applied once: by combine, or already in the weights") {
  std::mt19937 rng(46);
  for (bool applied : {false, true})
    for (float rsf : {1.0f, 2.5f}) {
      problem_spec s{.m = 33, .e = 16, .k = 4, .h = 24, .inter = 40, .routed_scaling = rsf, .scaling_applied = applied};
      check_problem(s, rng);
      s.no_combine = true;
      check_problem(s, rng);
    }
}

TEST_CASE("filtered slots (-1) contribute nothing, down to tokens with no expert at all") {
  std::mt19937 rng(47);
  for (double f : {0.1, 0.5, 1.0}) {
    problem_spec s{.m = 33, .e = 4, .k = 2, .h = 72, .inter = 40, .filtered = f};
    check_problem(s, rng);
  }
  // With every slot filtered the output is exactly zero, and still fully written.
  problem_spec s{.m = 7, .e = 4, .k = 2, .h = 24, .inter = 24, .filtered = 1.0};
  problem p(s, rng);
  mr::MoeRunner<mr::reference_policy> runner("reference", p.cfg);
  runner.run(p.dispatch(), mr::unquantized_quant_info{p.w13.view, p.w2.view}, p.out.view, {},
             mr::cpu_test::host_stream());
  for (std::int64_t i = 0; i < p.out.numel(); ++i) CHECK(p.out.ptr<float>()[i] == 0.0f);
}

TEST_CASE("all tokens on one expert, the other experts idle") {
  std::mt19937 rng(48);
  for (int k : {1, 4}) {
    problem_spec s{.m = 33, .e = 16, .k = k, .h = 40, .inter = 40, .w_type = mr::dtype::bf16};
    s.ids = problem_spec::ids_kind::one_expert;
    check_problem(s, rng);
  }
}

TEST_CASE("only the local experts' weights are held") {
  std::mt19937 rng(49);
  problem_spec s{.m = 33, .e = 16, .local = 4, .k = 2, .h = 24, .inter = 40, .filtered = 0.1};
  check_problem(s, rng);
}

TEST_CASE("inplace writes the output over the hidden states") {
  std::mt19937 rng(50);
  for (mr::dtype xt : float_types)
    for (int m : {1, 33}) {
      problem_spec s{.m = m, .e = 4, .k = 2, .h = 40, .inter = 72, .x_type = xt, .inplace = true, .filtered = 0.1};
      check_problem(s, rng);
    }
}

TEST_CASE("zero tokens: nothing to do, null pointers allowed") {
  std::mt19937 rng(51);
  problem_spec s{.m = 0, .e = 4, .k = 2, .h = 24, .inter = 24};
  problem p(s, rng);
  mr::MoeRunner<mr::reference_policy> runner("reference", p.cfg);
  mr::DispatchOutput d = p.dispatch();
  mr::tensor_view out = p.out.view;
  d.hidden_states.data = d.topk.topk_weights.data = d.topk.topk_ids.data = out.data = nullptr;
  const auto ci = runner.run(d, mr::unquantized_quant_info{p.w13.view, p.w2.view}, out, {}, mr::cpu_test::host_stream());
  CHECK(ci.hidden_states.numel() == 0);
}

TEST_CASE("fp8 block-scaled weights: per-token 128-group activation quantization, in and between the GEMMs") {
  std::mt19937 rng(52);
  int n = 0;
  for (int m : {0, 1, 7, 33})
    for (int e : {1, 4})
      for (int k : {1, 2}) {
        if (k > e) continue;
        for (auto [h, inter] : {std::pair{128, 128}, std::pair{256, 128}, std::pair{128, 256}, std::pair{192, 72}}) {
          problem_spec s{.m = m, .e = e, .k = k, .h = h, .inter = inter, .fp8 = true};
          s.x_type = float_types[n % 3];
          s.act.kind = act_kinds[n % 3];
          s.filtered = n % 5 == 0 ? 0.3 : 0.0;
          ++n;
          check_problem(s, rng);
        }
      }
  CHECK(n == 4 * 3 * 4);
}

TEST_CASE("fp8 per-tensor and per-channel weight scales, with the same activation quantization") {
  std::mt19937 rng(53);
  int n = 0;
  for (mr::fp8_weight_scaling scaling : {mr::fp8_weight_scaling::per_tensor, mr::fp8_weight_scaling::per_channel})
    for (int m : {0, 1, 9})
      for (auto [h, inter] : {std::pair{128, 256}, std::pair{192, 72}}) {
        problem_spec s{.m = m, .e = 4, .k = 2, .h = h, .inter = inter, .fp8 = true, .scaling = scaling};
        s.x_type = float_types[n % 3];
        s.act.kind = act_kinds[n % 3];
        s.interleaved = n % 4 == 1;
        s.router_on_input = n % 5 == 2;
        if (s.router_on_input) s.k = 1;
        s.filtered = n % 3 == 0 ? 0.3 : 0.0;
        ++n;
        check_problem(s, rng);
      }
  CHECK(n == 2 * 3 * 2);
}

TEST_CASE("gpt-oss: biases on both GEMMs and interleaved gate/up rows, against a hand computation") {
  // E = 1, k = 1, H = 2, I = 2, x = [1, 0]: row r of w13 x is w13[r][0], w2 is the identity.
  // w13[:, 0] = [a, b, c, d] and b13 = [p, q, r, s] give gate/up pairs (a+p, c+r), (b+q, d+s)
  // in halves order and (a+p, b+q), (c+r, d+s) interleaved; out = w * (act + b2).
  const mr::activation act{mr::activation_kind::swiglu_clamped, 1.702f, 7.0f};
  const auto swiglu = [&](double g, double u) {
    g = std::min(g, 7.0);
    u = std::clamp(u, -7.0, 7.0);
    return (u + 1.0) * g / (1.0 + std::exp(-1.702 * g));
  };
  const float w13_col0[4] = {0.5f, -1.0f, 2.0f, 0.25f}, b13v[4] = {0.25f, 0.5f, -0.75f, 1.5f};
  const float b2v[2] = {-0.5f, 2.0f};
  const float weight = 0.75f;
  host_tensor x(mr::dtype::f32, {1, 2}), w13(mr::dtype::f32, {1, 4, 2}), w2(mr::dtype::f32, {1, 2, 2}),
      b13(mr::dtype::f32, {1, 4}), b2(mr::dtype::f32, {1, 2}), wts(mr::dtype::f32, {1, 1}),
      ids(mr::dtype::i32, {1, 1}), out(mr::dtype::f32, {1, 2});
  x.ptr<float>()[0] = 1.0f;
  x.ptr<float>()[1] = 0.0f;
  for (int r = 0; r < 4; ++r) {
    w13.ptr<float>()[r * 2] = w13_col0[r];
    w13.ptr<float>()[r * 2 + 1] = 3.0f;  // multiplies x[1] = 0
    b13.ptr<float>()[r] = b13v[r];
  }
  const float identity[4] = {1.0f, 0.0f, 0.0f, 1.0f};
  for (int i = 0; i < 4; ++i) w2.ptr<float>()[i] = identity[i];
  b2.ptr<float>()[0] = b2v[0];
  b2.ptr<float>()[1] = b2v[1];
  wts.ptr<float>()[0] = weight;
  ids.ptr<std::int32_t>()[0] = 0;
  const double h[4] = {w13_col0[0] + b13v[0], w13_col0[1] + b13v[1], w13_col0[2] + b13v[2], w13_col0[3] + b13v[3]};
  for (mr::w13_layout layout : {mr::w13_layout::halves, mr::w13_layout::interleaved}) {
    CAPTURE(mr::w13_layout_name(layout));
    const bool inter = layout == mr::w13_layout::interleaved;
    const double want[2] = {weight * (swiglu(h[0], inter ? h[1] : h[2]) + b2v[0]),
                            weight * (swiglu(inter ? h[2] : h[1], h[3]) + b2v[1])};
    mr::MoeRunner<mr::reference_policy> runner(
        "reference", mr::MoeRunnerConfig({.num_experts = 1, .hidden_size = 2, .intermediate_size = 2, .top_k = 1,
                                          .act = act, .gate_up_layout = layout}));
    runner.run({x.view, {}, {wts.view, ids.view}}, mr::unquantized_quant_info{w13.view, w2.view, b13.view, b2.view},
               out.view, {}, mr::cpu_test::host_stream());
    CHECK(out.ptr<float>()[0] == doctest::Approx(want[0]).epsilon(1e-6));
    CHECK(out.ptr<float>()[1] == doctest::Approx(want[1]).epsilon(1e-6));
    // Without biases: the same pairs of w13 rows alone.
    const double g0 = w13_col0[0], u0 = inter ? w13_col0[1] : w13_col0[2];
    runner.run({x.view, {}, {wts.view, ids.view}}, mr::unquantized_quant_info{w13.view, w2.view}, out.view, {},
               mr::cpu_test::host_stream());
    CHECK(out.ptr<float>()[0] == doctest::Approx(weight * swiglu(g0, u0)).epsilon(1e-6));
  }
  // The two layouts differ on this data, so the checks above tell them apart.
  CHECK(swiglu(h[0], h[1]) != doctest::Approx(swiglu(h[0], h[2])));
}

TEST_CASE("gpt-oss: biases and interleaved gate/up against the naive loop, every dtype and mode") {
  std::mt19937 rng(56);
  int n = 0;
  for (bool interleaved : {false, true})
    for (bool bias : {false, true})
      for (mr::dtype wt : float_types)
        for (mr::dtype bt : {mr::dtype::f32, wt}) {
          problem_spec s{.m = 33, .e = 8, .k = 2, .h = odd_sizes[n % 3], .inter = odd_sizes[(n + 1) % 3],
                         .x_type = wt, .w_type = wt};
          s.act = {mr::activation_kind::swiglu_clamped, 1.702f, n % 2 ? 0.75f : 7.0f};
          s.x_range = 3.0f;
          s.interleaved = interleaved;
          s.bias = bias;
          s.bias_type = bt;
          s.filtered = n % 4 == 0 ? 0.25 : 0.0;
          s.routed_scaling = n % 3 == 0 ? 2.5f : 1.0f;
          ++n;
          check_problem(s, rng);
        }
  // With the router weight on the input (b13 not scaled, b2 not weighted), no_combine, inplace, silu.
  for (bool interleaved : {false, true}) {
    problem_spec a{.m = 9, .e = 4, .k = 1, .h = 24, .inter = 40, .router_on_input = true};
    a.interleaved = interleaved;
    a.bias = true;
    check_problem(a, rng);
    problem_spec b{.m = 9, .e = 4, .k = 3, .h = 40, .inter = 24, .x_type = mr::dtype::bf16,
                   .w_type = mr::dtype::bf16, .no_combine = true};
    b.interleaved = interleaved;
    b.bias = true;
    b.bias_type = mr::dtype::bf16;
    check_problem(b, rng);
    problem_spec c{.m = 9, .e = 4, .k = 2, .h = 24, .inter = 72, .x_type = mr::dtype::f16,
                   .w_type = mr::dtype::f16, .inplace = true};
    c.interleaved = interleaved;
    c.bias = true;
    check_problem(c, rng);
  }
  // fp8 weights take the layout too (no biases in that format).
  problem_spec f{.m = 7, .e = 4, .k = 2, .h = 128, .inter = 128, .fp8 = true};
  f.interleaved = true;
  f.act.kind = mr::activation_kind::swiglu_clamped;
  check_problem(f, rng);
}

TEST_CASE("fp8 hidden states with their scales give a bf16 output") {
  std::mt19937 rng(53);
  for (int m : {1, 7, 33})
    for (auto [h, inter] : {std::pair{128, 128}, std::pair{256, 256}, std::pair{192, 72}}) {
      problem_spec s{.m = m, .e = 4, .k = 2, .h = h, .inter = inter, .fp8 = true, .fp8_input = true};
      check_problem(s, rng);
    }
}

TEST_CASE("fp8 with the router weight on the input, scaling, no_combine and inplace") {
  std::mt19937 rng(54);
  problem_spec a{.m = 33, .e = 4, .k = 1, .h = 256, .inter = 128, .router_on_input = true, .fp8 = true};
  check_problem(a, rng);
  problem_spec b{.m = 7, .e = 4, .k = 2, .h = 128, .inter = 256, .x_type = mr::dtype::bf16, .no_combine = true,
                 .routed_scaling = 2.5f, .filtered = 0.25, .fp8 = true};
  check_problem(b, rng);
  problem_spec c{.m = 7, .e = 4, .k = 2, .h = 128, .inter = 128, .x_type = mr::dtype::f16, .inplace = true,
                 .routed_scaling = 0.5f, .scaling_applied = true, .fp8 = true};
  check_problem(c, rng);
}

TEST_CASE("the reference is deterministic: two runs give the same bits") {
  std::mt19937 rng(55);
  problem_spec s{.m = 33, .e = 16, .k = 4, .h = 72, .inter = 40, .x_type = mr::dtype::bf16, .w_type = mr::dtype::bf16};
  problem p(s, rng);
  mr::MoeRunner<mr::reference_policy> runner("reference", p.cfg);
  host_tensor again = p.out;
  runner.run(p.dispatch(), mr::unquantized_quant_info{p.w13.view, p.w2.view}, p.out.view, {},
             mr::cpu_test::host_stream());
  runner.run(p.dispatch(), mr::unquantized_quant_info{p.w13.view, p.w2.view}, again.view, {},
             mr::cpu_test::host_stream());
  CHECK(p.out.bytes() == again.bytes());
}

// The row kernels of the GPU pipeline against host computations: gather (byte for byte),
// gated activation (within the output dtype's rounding of the f64 reference) and combine
// (bit for bit against an f32 emulation of its fixed summation order, and across 100 runs).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "gpu_test_util.hpp"
#include "moerunner/gpu/activation.cuh"
#include "moerunner/gpu/combine.cuh"
#include "moerunner/gpu/gather.cuh"
#include "moerunner/gpu/permute.cuh"
#include "moerunner/reference/activation.hpp"
#include "plan_test_util.hpp"

namespace mr = moerunner;
using mr::test::device_buffer;
using mr::test::device_tensor;
using mr::test::host_tensor;

namespace {

constexpr unsigned char poison_byte = 0x5a;

struct shape {
  std::int64_t m;
  int k, e;
};
constexpr shape shapes[] = {{0, 2, 8}, {1, 8, 256}, {7, 2, 8}, {1000, 8, 128}};

// Routing for a shape: 15% of slots filtered, plus one token with every slot filtered.
std::vector<std::int32_t> routed_ids(const shape& s, std::mt19937& rng) {
  auto ids = mr::test::random_ids(s.m, s.k, s.e, 0.15, rng);
  if (s.m > 3)
    for (int j = 0; j < s.k; ++j) ids[3 * s.k + j] = -1;
  return ids;
}

bool untouched(const unsigned char* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (p[i] != poison_byte) return false;
  return true;
}

std::string dims(const shape& s) {
  return "M=" + std::to_string(s.m) + " k=" + std::to_string(s.k) + " E=" + std::to_string(s.e);
}

}  // namespace

TEST_CASE("a failed runtime call is reported once: no last error is left for the next launch check") {
  int count = 0;
  MOE_CUDA_CHECK(cudaGetDeviceCount(&count));
  CHECK_THROWS_AS(MOE_CUDA_CHECK(cudaSetDevice(count)), mr::cuda_error);  // one past the last device
  CHECK(cudaGetLastError() == cudaSuccess);
  int current = -1;
  MOE_CUDA_CHECK(cudaGetDevice(&current));
  CHECK(current >= 0);
}

TEST_CASE("gather_rows copies each valid row from its token and leaves the rest untouched") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (const shape& s : shapes)
    for (mr::dtype t : {mr::dtype::bf16, mr::dtype::f16, mr::dtype::f32})
      for (int h : {8, 13, 4096})
        for (bool offset_rows : {false, true}) {  // rows one element off 16-byte alignment: element copies
          CAPTURE(dims(s));
          CAPTURE(mr::dtype_name(t));
          CAPTURE(h);
          CAPTURE(offset_rows);
          const auto ids = routed_ids(s, rng);
          const mr::test::expected_plan want = mr::test::expect_plan(ids, s.e);
          mr::test::device_plan d(ids, s.m, s.k, s.e);
          host_tensor x(t, {s.m, h});
          mr::test::fill_random(x, rng);
          device_tensor dx(x);
          const std::size_t row_bytes = h * mr::dtype_size(t), slots = static_cast<std::size_t>(s.m) * s.k;
          const std::size_t shift = offset_rows ? mr::dtype_size(t) : 0;
          device_buffer rows(slots * row_bytes + 16);
          rows.poison(poison_byte);
          mr::gpu::gather_rows(dx.view, d.plan, static_cast<char*>(rows.get()) + shift, nullptr);
          MOE_CUDA_CHECK(cudaDeviceSynchronize());
          const auto got = rows.download<unsigned char>(rows.bytes());
          const auto* xb = static_cast<const unsigned char*>(x.view.data);
          const std::size_t valid = static_cast<std::size_t>(want.offsets[s.e]);
          for (std::size_t r = 0; r < valid; ++r) {
            const std::size_t token = static_cast<std::size_t>(want.row_to_slot[r] / s.k);
            REQUIRE(std::memcmp(got.data() + shift + r * row_bytes, xb + token * row_bytes, row_bytes) == 0);
          }
          CHECK(untouched(got.data(), shift));
          CHECK(untouched(got.data() + shift + valid * row_bytes, got.size() - shift - valid * row_bytes));
        }
}

TEST_CASE("gated_activation matches the f64 reference within the dtype's rounding") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const shape& s : {shape{0, 2, 8}, shape{7, 2, 8}, shape{300, 8, 64}})
    for (mr::dtype t : {mr::dtype::bf16, mr::dtype::f16})
      for (auto kind : {mr::activation_kind::silu, mr::activation_kind::gelu, mr::activation_kind::swiglu_clamped})
        for (bool gated : {true, false})
          for (int inter : {8, 13, 768}) {
            if (!gated && kind == mr::activation_kind::swiglu_clamped) continue;
            CAPTURE(dims(s));
            CAPTURE(mr::dtype_name(t));
            CAPTURE(mr::activation_name(kind));
            CAPTURE(gated);
            CAPTURE(inter);
            const mr::activation act{.kind = kind, .alpha = 1.702f, .limit = 7.0f};
            const auto ids = routed_ids(s, rng);
            const mr::test::expected_plan want = mr::test::expect_plan(ids, s.e);
            mr::test::device_plan d(ids, s.m, s.k, s.e);
            const std::int64_t rows = s.m * s.k, in_cols = gated ? 2 * inter : inter;
            const std::int64_t valid = want.offsets[s.e];
            host_tensor in(t, {rows, in_cols});
            mr::test::fill_random(in, rng, 9.0f);  // past the swiglu limit on both sides
            if (valid > 0) {  // NaN in a gate and in an up value stays in that element
              mr::test::set_element(in.view, 0, nan);
              if (gated && inter > 1) mr::test::set_element(in.view, inter + 1, nan);
            }
            device_tensor din(in);
            device_buffer out(static_cast<std::size_t>(rows) * inter * mr::dtype_size(t));
            out.poison(poison_byte);
            mr::gpu::gated_activation(din.view.data, out.get(), t, inter, gated, act, d.plan, nullptr);
            MOE_CUDA_CHECK(cudaDeviceSynchronize());
            host_tensor got(t, {rows, inter});
            if (out.bytes()) MOE_CUDA_CHECK(cudaMemcpy(got.view.data, out.get(), out.bytes(), cudaMemcpyDeviceToHost));
            // Half an ulp of the output dtype, plus f32 evaluation error; absolute floor for fp16 subnormals.
            const double rel = (t == mr::dtype::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11)) + 1e-5;
            int bad = 0;
            for (std::int64_t r = 0; r < valid; ++r)
              for (int c = 0; c < inter; ++c) {
                const double gate = mr::test::element(in.view, r * in_cols + c);
                const double up = gated ? mr::test::element(in.view, r * in_cols + inter + c) : 0.0;
                const double ref = mr::reference::apply_activation(act, gated, gate, up);
                const double y = mr::test::element(got.view, r * inter + c);
                const bool ok = std::isnan(ref) ? std::isnan(y) : std::fabs(y - ref) <= rel * std::fabs(ref) + 1e-6;
                if (!ok && ++bad <= 5) MESSAGE("row " << r << " col " << c << ": gpu " << y << " reference " << ref);
              }
            CHECK(bad == 0);
            const std::size_t tail = static_cast<std::size_t>(valid) * inter * mr::dtype_size(t);
            CHECK(untouched(static_cast<const unsigned char*>(got.view.data) + tail, out.bytes() - tail));
          }
}

namespace {

// What combine_rows computes, in the same f32 operations and order, rounded as the device rounds.
std::vector<float> emulate_combine(const host_tensor& rows, const mr::test::expected_plan& plan, const shape& s,
                                   int h, const float* weights, float scale, bool no_combine, int splits = 1) {
  const std::int64_t part = s.m * s.k * static_cast<std::int64_t>(h);
  std::vector<float> out(static_cast<std::size_t>(s.m) * (no_combine ? s.k : 1) * h);
  for (std::int64_t t = 0; t < s.m; ++t)
    for (int c = 0; c < h; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < s.k; ++j) {
        const std::int64_t slot = t * s.k + j;
        const std::int32_t r = plan.slot_to_row[slot];
        float v = 0.0f;
        if (r >= 0) {
          v = mr::test::element(rows.view, static_cast<std::int64_t>(r) * h + c);
          for (int p = 1; p < splits; ++p) v += mr::test::element(rows.view, p * part + static_cast<std::int64_t>(r) * h + c);
          if (!no_combine) acc = weights ? std::fma(weights[slot], v, acc) : acc + v;
          v = scale * ((weights ? weights[slot] : 1.0f) * v);
        }
        if (no_combine) out[slot * h + c] = v;
      }
      if (!no_combine) out[t * h + c] = acc * scale;
    }
  return out;
}

bool same_bits(const host_tensor& got, std::int64_t i, float want, mr::dtype t) {
  host_tensor w(t, {1});
  mr::test::set_element(w.view, 0, want);
  const float g = mr::test::element(got.view, i), r = mr::test::element(w.view, 0);
  if (std::isnan(g) || std::isnan(r)) return std::isnan(g) && std::isnan(r);
  return std::memcmp(static_cast<const unsigned char*>(got.view.data) + i * mr::dtype_size(t), w.view.data,
                     mr::dtype_size(t)) == 0;
}

// Elements of `got` whose bits differ from `want` rounded to type t; the first five are reported.
int bit_mismatches(const host_tensor& got, const std::vector<float>& want, mr::dtype t) {
  int bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!same_bits(got, static_cast<std::int64_t>(i), want[i], t) && ++bad <= 5)
      MESSAGE("element " << i << ": gpu " << mr::test::element(got.view, i) << " expected " << want[i]);
  return bad;
}

struct combine_setup {
  shape s;
  int h;
  mr::dtype in_t, out_t;
  bool use_weights, no_combine;
  float scale;
  int splits;
  std::vector<std::int32_t> ids;
  mr::test::expected_plan want;
  mr::test::device_plan d;
  host_tensor rows, weights;
  device_tensor d_rows, d_weights;
  device_buffer out;
  mr::tensor_view out_view;

  combine_setup(const shape& s_, int h_, mr::dtype in, mr::dtype o, bool w, bool nc, float sc, std::mt19937& rng,
                int splits_ = 1)
      : s(s_), h(h_), in_t(in), out_t(o), use_weights(w), no_combine(nc), scale(sc), splits(splits_),
        ids(routed_ids(s, rng)), want(mr::test::expect_plan(ids, s.e)), d(ids, s.m, s.k, s.e),
        rows(in, {splits_ * s.m * s.k, h}), weights(mr::dtype::f32, {s.m, s.k}) {
    mr::test::fill_random(rows, rng, 2.0f);
    // Rows past the valid count (in every part) must never be read: NaN there would show in the output.
    const std::int64_t valid = want.offsets[s.e], part = s.m * s.k * static_cast<std::int64_t>(h);
    for (int p = 0; p < splits; ++p)
      for (std::int64_t i = valid * h; i < part; ++i)
        mr::test::set_element(rows.view, p * part + i, std::numeric_limits<float>::quiet_NaN());
    std::uniform_real_distribution<float> u(0.05f, 1.0f);
    for (std::int64_t i = 0; i < weights.numel(); ++i) weights.view.ptr<float>()[i] = u(rng);
    d_rows = device_tensor(rows);
    d_weights = device_tensor(weights);
    out_view = no_combine ? mr::tensor_view::contiguous(nullptr, o, {s.m, s.k, h}, mr::memory_space::device)
                          : mr::tensor_view::contiguous(nullptr, o, {s.m, h}, mr::memory_space::device);
    out = device_buffer(out_view.bytes());
    out_view.data = out.get();
  }

  // What the run should give, from the f32 emulation of combine_rows.
  std::vector<float> expected() const {
    return emulate_combine(rows, want, s, h, use_weights ? weights.view.ptr<const float>() : nullptr, scale, no_combine,
                           splits);
  }

  host_tensor run() {
    out.poison(poison_byte);
    mr::gpu::combine_rows(d_rows.view.data, in_t, d.plan, use_weights ? d_weights.view.ptr<const float>() : nullptr,
                          scale, out_view, no_combine, nullptr, splits);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    host_tensor got = no_combine ? host_tensor(out_t, {s.m, s.k, h}) : host_tensor(out_t, {s.m, h});
    if (out.bytes()) MOE_CUDA_CHECK(cudaMemcpy(got.view.data, out.get(), out.bytes(), cudaMemcpyDeviceToHost));
    return got;
  }
};

}  // namespace

TEST_CASE("combine_rows is bit-identical to an f32 emulation of its fixed order") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  int n = 0;
  for (const shape& s : shapes)
    for (mr::dtype in_t : {mr::dtype::bf16, mr::dtype::f16})
      for (mr::dtype out_t : {in_t, mr::dtype::f32})
        for (int h : {8, 13, 2048})
          for (bool no_combine : {false, true}) {
            const bool use_weights = n % 2 == 0;
            const float scale = n % 3 == 0 ? 2.5f : 1.0f;
            ++n;
            CAPTURE(dims(s));
            CAPTURE(mr::dtype_name(in_t));
            CAPTURE(mr::dtype_name(out_t));
            CAPTURE(h);
            CAPTURE(no_combine);
            CAPTURE(use_weights);
            CAPTURE(scale);
            combine_setup cs(s, h, in_t, out_t, use_weights, no_combine, scale, rng);
            const host_tensor got = cs.run();
            CHECK(bit_mismatches(got, cs.expected(), out_t) == 0);
            if (s.m > 3) {  // the fully filtered token is zero
              const std::int64_t per_token = (no_combine ? s.k : 1) * static_cast<std::int64_t>(h);
              for (std::int64_t i = 3 * per_token; i < 4 * per_token; ++i) REQUIRE(mr::test::element(got.view, i) == 0.0f);
            }
          }
}

TEST_CASE("combine_rows sums f32 row parts (K-split partial sums) in order, bit for bit") {
  const std::uint32_t seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  int n = 0;
  for (const shape& s : shapes)
    for (int splits : {1, 2, 7})
      for (int h : {8, 13, 2048})
        for (bool no_combine : {false, true}) {
          const bool use_weights = n % 2 == 0;
          const float scale = n % 3 == 0 ? 2.5f : 1.0f;
          ++n;
          CAPTURE(dims(s));
          CAPTURE(splits);
          CAPTURE(h);
          CAPTURE(no_combine);
          combine_setup cs(s, h, mr::dtype::f32, mr::dtype::bf16, use_weights, no_combine, scale, rng, splits);
          CHECK(bit_mismatches(cs.run(), cs.expected(), mr::dtype::bf16) == 0);
        }
}

TEST_CASE("combine_rows gives the same bits on 100 runs") {
  std::mt19937 rng(mr::test::test_seed());
  combine_setup cs({1000, 8, 128}, 2048, mr::dtype::bf16, mr::dtype::bf16, true, false, 2.5f, rng);
  const host_tensor first = cs.run();
  for (int run = 0; run < 99; ++run) {
    const host_tensor again = cs.run();
    REQUIRE(std::memcmp(first.view.data, again.view.data, first.view.bytes()) == 0);
  }
}

TEST_CASE("row kernels: bad arguments throw and write nothing") {
  std::mt19937 rng(3);
  const shape s{4, 2, 8};
  const auto ids = routed_ids(s, rng);
  mr::test::device_plan d(ids, s.m, s.k, s.e);
  const int h = 16;
  device_buffer rows(s.m * s.k * h * 2), out(s.m * s.k * h * 4);
  rows.poison(0);
  out.poison(poison_byte);
  const auto x = mr::tensor_view::contiguous(rows.get(), mr::dtype::bf16, {s.m, h}, mr::memory_space::device);
  auto x_wrong_m = mr::tensor_view::contiguous(rows.get(), mr::dtype::bf16, {s.m + 1, h}, mr::memory_space::device);
  CHECK_THROWS_AS(mr::gpu::gather_rows(x_wrong_m, d.plan, out.get(), nullptr), mr::invalid_argument_error);
  auto x_host = x;
  x_host.space = mr::memory_space::host;
  CHECK_THROWS_AS(mr::gpu::gather_rows(x_host, d.plan, out.get(), nullptr), mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::gather_rows(x, mr::gpu::routing_plan{}, out.get(), nullptr), mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::gated_activation(rows.get(), out.get(), mr::dtype::f32, h, true, {}, d.plan, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::gated_activation(rows.get(), out.get(), mr::dtype::bf16, 0, true, {}, d.plan, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::gated_activation(rows.get(), out.get(), mr::dtype::bf16, h, false,
                                            {.kind = mr::activation_kind::swiglu_clamped}, d.plan, nullptr),
                  mr::invalid_argument_error);
  const auto out2 = mr::tensor_view::contiguous(out.get(), mr::dtype::bf16, {s.m, h}, mr::memory_space::device);
  const auto out3 = mr::tensor_view::contiguous(out.get(), mr::dtype::bf16, {s.m, s.k, h}, mr::memory_space::device);
  const auto out_i32 = mr::tensor_view::contiguous(out.get(), mr::dtype::i32, {s.m, h}, mr::memory_space::device);
  CHECK_THROWS_AS(mr::gpu::combine_rows(rows.get(), mr::dtype::bf16, d.plan, nullptr, 1.0f, out3, false, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::combine_rows(rows.get(), mr::dtype::bf16, d.plan, nullptr, 1.0f, out2, true, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::combine_rows(rows.get(), mr::dtype::bf16, d.plan, nullptr, 1.0f, out_i32, false, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::combine_rows(rows.get(), mr::dtype::i32, d.plan, nullptr, 1.0f, out2, false, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::combine_rows(rows.get(), mr::dtype::bf16, d.plan, nullptr, 1.0f, out2, false, nullptr, 0),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::combine_rows(static_cast<char*>(rows.get()) + 2, mr::dtype::f32, d.plan, nullptr, 1.0f,
                                        out2, false, nullptr),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(mr::gpu::combine_rows(rows.get(), mr::dtype::bf16, d.plan, nullptr, NAN, out2, false, nullptr),
                  mr::invalid_argument_error);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (unsigned char b : out.download<unsigned char>(out.bytes())) REQUIRE(b == poison_byte);
}

int main(int argc, char** argv) {
  if (!mr::test::have_gpu()) {
    std::puts("no GPU: skipping the row kernel tests");
    return mr::test::skip_exit_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}

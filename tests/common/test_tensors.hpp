// Host tensors for the CPU and GPU tests: owned storage with a contiguous view onto it,
// element stores rounded to the view's dtype, element loads as the library reads them, random
// fills, and fp8 block quantization.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <vector>

#include "moerunner/core/host_float.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/reference/routing.hpp"

namespace moerunner::test {

// Owns host memory (8-byte aligned) and a contiguous view onto it; copies rebind the view to
// their own storage.
struct host_tensor {
  std::vector<std::uint64_t> storage;
  tensor_view view;

  host_tensor() = default;
  host_tensor(dtype t, std::initializer_list<std::int64_t> dims) {
    view = tensor_view::contiguous(nullptr, t, dims, memory_space::host);
    storage.resize(view.bytes() / 8 + 1);
    view.data = storage.data();
  }
  host_tensor(const host_tensor& o) : storage(o.storage), view(o.view) { view.data = storage.data(); }
  host_tensor& operator=(const host_tensor& o) {
    storage = o.storage;
    view = o.view;
    view.data = storage.data();
    return *this;
  }
  host_tensor(host_tensor&&) noexcept = default;
  host_tensor& operator=(host_tensor&&) noexcept = default;

  std::int64_t numel() const { return view.numel(); }
  std::vector<unsigned char> bytes() const {
    const auto* p = static_cast<const unsigned char*>(view.data);
    return {p, p + view.bytes()};
  }
  template <class T>
  T* ptr() const { return view.ptr<T>(); }
};

// Stores v rounded to the tensor's dtype (how tests write inputs).
inline void set_element(const tensor_view& t, std::int64_t i, float v) {
  switch (t.type) {
    case dtype::f32: t.ptr<float>()[i] = v; break;
    case dtype::bf16: t.ptr<std::uint16_t>()[i] = host_float::float_to_bf16(v); break;
    case dtype::f16: t.ptr<std::uint16_t>()[i] = host_float::float_to_half(v); break;
    case dtype::f8_e4m3: t.ptr<std::uint8_t>()[i] = host_float::float_to_e4m3(v); break;
    case dtype::i32: t.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(v); break;
  }
}

// Element i as the library's host code reads it.
inline float element(const tensor_view& t, std::int64_t i) { return reference::detail::load_as_float(t, i); }

// Uniform random values in [lo, hi), rounded to the tensor's dtype.
inline void fill_uniform(host_tensor& t, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  for (std::int64_t i = 0; i < t.numel(); ++i) set_element(t.view, i, d(rng));
}

// Uniform random values in [-scale, scale).
inline void fill_random(host_tensor& t, std::mt19937& rng, float scale = 1.0f) { fill_uniform(t, rng, -scale, scale); }

// w ([rows, cols] or [E, rows, cols], any float dtype) as e4m3 with one f32 scale per block of
// block_rows x block_cols (amax / 448, 1 for an all-zero block), as fp8 checkpoints ship weights
// (block_rows 128) and activations arrive quantized per token and 128 columns (block_rows 1):
// q has w's shape, scale [E,] ceil(rows / block_rows), ceil(cols / block_cols).
inline void quantize_e4m3_blocks(const host_tensor& w, int block_rows, host_tensor& q, host_tensor& scale,
                                 std::int64_t block_cols = 128) {
  const bool experts = w.view.rank == 3;
  const std::int64_t e = experts ? w.view.shape[0] : 1, rows = w.view.shape[w.view.rank - 2],
                     cols = w.view.shape[w.view.rank - 1];
  const std::int64_t br = (rows + block_rows - 1) / block_rows, bc = (cols + block_cols - 1) / block_cols;
  q = experts ? host_tensor(dtype::f8_e4m3, {e, rows, cols}) : host_tensor(dtype::f8_e4m3, {rows, cols});
  scale = experts ? host_tensor(dtype::f32, {e, br, bc}) : host_tensor(dtype::f32, {br, bc});
  for (std::int64_t x = 0; x < e; ++x)
    for (std::int64_t b = 0; b < br; ++b)
      for (std::int64_t c = 0; c < bc; ++c) {
        const std::int64_t r_end = std::min(rows, (b + 1) * block_rows);
        const std::int64_t c_end = std::min(cols, (c + 1) * block_cols);
        float amax = 0.0f;
        for (std::int64_t r = b * block_rows; r < r_end; ++r)
          for (std::int64_t k = c * block_cols; k < c_end; ++k)
            amax = std::max(amax, std::fabs(element(w.view, (x * rows + r) * cols + k)));
        const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
        scale.view.ptr<float>()[(x * br + b) * bc + c] = s;
        for (std::int64_t r = b * block_rows; r < r_end; ++r)
          for (std::int64_t k = c * block_cols; k < c_end; ++k) {
            const std::int64_t i = (x * rows + r) * cols + k;
            q.view.ptr<std::uint8_t>()[i] = host_float::float_to_e4m3(element(w.view, i) / s);
          }
      }
}

// w [E, rows, cols] as e4m3 with one f32 scale per row (scale [E, rows], per_tensor false) or
// per expert matrix (scale [E]), amax / 448 as above: the per-channel and per-tensor checkpoints.
inline void quantize_e4m3_rows(const host_tensor& w, bool per_tensor, host_tensor& q, host_tensor& scale) {
  const std::int64_t e = w.view.shape[0], rows = w.view.shape[1], cols = w.view.shape[2];
  host_tensor blocks;
  quantize_e4m3_blocks(w, per_tensor ? static_cast<int>(rows) : 1, q, blocks, cols);
  scale = per_tensor ? host_tensor(dtype::f32, {e}) : host_tensor(dtype::f32, {e, rows});
  std::copy_n(blocks.ptr<const float>(), scale.numel(), scale.ptr<float>());
}

}  // namespace moerunner::test

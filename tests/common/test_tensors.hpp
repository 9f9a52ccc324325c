// Host tensors for the CPU and GPU tests: owned storage with a contiguous view onto it,
// element stores rounded to the view's dtype, element loads as the library reads them, and
// random fills.
#pragma once

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

}  // namespace moerunner::test

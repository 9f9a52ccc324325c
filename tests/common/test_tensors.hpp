// Host tensors for the CPU and GPU tests: owned storage with a contiguous view onto it, and
// element stores rounded to the view's dtype.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "moerunner/core/host_float.hpp"
#include "moerunner/core/tensor_view.hpp"

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

}  // namespace moerunner::test

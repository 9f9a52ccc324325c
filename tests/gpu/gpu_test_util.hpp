// Shared helpers for the GPU tests: skip without a GPU, device buffers, the error measure
// (host tensors, element loads and random fills: tests/common).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "moerunner/core/host_float.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/reference/routing.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "../common/test_seed.hpp"
#include "../common/test_tensors.hpp"

namespace moerunner::test {

// Meson reads exit code 77 as "skipped".
inline constexpr int skip_exit_code = 77;

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Owns device memory; freed on scope exit.
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_) MOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~device_buffer() { if (ptr_) cudaFree(ptr_); }
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

  template <class T>
  void upload(const std::vector<T>& h) {
    if (!h.empty()) MOE_CUDA_CHECK(cudaMemcpy(ptr_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  std::vector<T> download(std::size_t n) const {
    std::vector<T> h(n);
    if (n) MOE_CUDA_CHECK(cudaMemcpy(h.data(), ptr_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  // Fills with a byte pattern so that unwritten elements are visible (0xff.. is NaN in every float type).
  void poison(unsigned char byte = 0xff) {
    if (bytes_) MOE_CUDA_CHECK(cudaMemset(ptr_, byte, bytes_));
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Device tensor mirroring a host one.
struct device_tensor {
  device_buffer buf;
  tensor_view view;
  device_tensor() = default;
  explicit device_tensor(const host_tensor& h) : buf(h.view.bytes()) {
    view = h.view;
    view.data = buf.get();
    view.space = memory_space::device;
    if (h.view.bytes()) MOE_CUDA_CHECK(cudaMemcpy(buf.get(), h.view.data, h.view.bytes(), cudaMemcpyHostToDevice));
  }
  void to_host(host_tensor& h) const {
    if (view.bytes()) MOE_CUDA_CHECK(cudaMemcpy(h.view.data, buf.get(), view.bytes(), cudaMemcpyDeviceToHost));
  }
};

// A moe_status in device memory, zeroed when made, and read back.
struct device_status {
  device_buffer buf{sizeof(moe_status)};
  device_status() { zero(); }
  moe_status* get() const { return static_cast<moe_status*>(buf.get()); }
  void zero() { MOE_CUDA_CHECK(cudaMemset(buf.get(), 0, sizeof(moe_status))); }
  moe_status read() const {
    moe_status h;
    MOE_CUDA_CHECK(cudaMemcpy(&h, buf.get(), sizeof h, cudaMemcpyDeviceToHost));
    return h;
  }
};

// ||a - b|| / ||b|| over all elements; NaN anywhere in a (or a mismatch in NaN-ness) gives +inf.
inline double rel_error(const tensor_view& a, const tensor_view& b) {
  double num = 0.0, den = 0.0;
  for (std::int64_t i = 0; i < b.numel(); ++i) {
    const double x = element(a, i), y = element(b, i);
    if (std::isnan(x) != std::isnan(y) || std::isinf(x)) return INFINITY;
    if (std::isnan(y)) continue;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace moerunner::test

// DLPack arrays (nanobind ndarrays from torch, CuPy, JAX, numpy) as the library's tensor_views:
// dtype, shape, element strides, memory space and pointer taken as they are, so that the
// library's own checks judge them. Only what a tensor_view cannot describe is refused here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nanobind/ndarray.h>

#include "moerunner/moerunner.hpp"

namespace moerunner::python {

namespace nb = nanobind;

// The dtype's DLPack spelling, for a message about a dtype the library has no name for.
inline std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  using code = nb::dlpack::dtype_code;
  std::string base;
  switch (static_cast<code>(t.code)) {
    case code::Int: base = "int"; break;
    case code::UInt: base = "uint"; break;
    case code::Float: base = "float"; break;
    case code::Bfloat: base = "bfloat"; break;
    case code::Complex: base = "complex"; break;
    case code::Bool: return "bool";
    case code::Float8_E4M3FN: return "float8_e4m3fn";
    case code::Float8_E5M2: return "float8_e5m2";
    default: return "DLPack type code " + std::to_string(t.code);
  }
  base += std::to_string(t.bits);
  if (t.lanes != 1) base += 'x' + std::to_string(t.lanes);
  return base;
}

// Converts a call's array arguments, checking that its device tensors share one device.
class tensor_args {
 public:
  explicit tensor_args(const char* where) : where_(where) {}

  tensor_view operator()(const nb::ndarray<>& a, const char* what) {
    return view_as(a, dtype_of(a.dtype(), what), what);
  }

  // None is an empty view, which the library reads as "not given".
  tensor_view operator()(const std::optional<nb::ndarray<>>& a, const char* what) {
    return a ? (*this)(*a, what) : tensor_view{};
  }

  // A byte buffer (the workspace): any dtype of whole bytes, dense and row-major, in `expected`
  // memory; its pointer and size in bytes. The view is typed as the 1-byte f8_e4m3 only for the
  // library's checks of space and layout, which count shape and strides in elements.
  workspace_view bytes(const nb::ndarray<>& a, memory_space expected, const char* what) {
    const nb::dlpack::dtype t = a.dtype();
    const std::size_t bits = static_cast<std::size_t>(t.bits) * t.lanes;
    MOE_EXPECT(bits % 8 == 0, where_, std::string(what) + " has dtype " + dlpack_dtype_name(t) + ", not whole bytes");
    const tensor_view v = view_as(a, dtype::f8_e4m3, what);
    check::space(v, expected, where_, what);
    check::contiguous(v, where_, what);
    return {v.data, static_cast<std::size_t>(v.numel()) * (bits / 8)};
  }

  // The CUDA device of the device tensors, -1 when every tensor is on the host.
  int device() const { return device_; }

 private:
  // The array as a view of elements of type `type`: shape, strides, space, pointer as they are.
  tensor_view view_as(const nb::ndarray<>& a, dtype type, const char* what) {
    tensor_view v;
    v.type = type;
    v.space = space_of(a, what);
    const int rank = static_cast<int>(a.ndim());
    if (auto problem = detail::tensor_shape_problem(v.type, v.space, rank, a.shape_ptr()); !problem.empty())
      detail::throw_invalid(where_, std::string(what) + " " + problem);
    v.rank = rank;
    for (int d = 0; d < rank; ++d) {
      v.shape[d] = a.shape(d);
      v.strides[d] = a.stride(d);
    }
    // The strides of an array without elements address nothing, and frameworks report them
    // freely (numpy's export of an empty array, for one): row-major strides describe it.
    if (v.numel() == 0) {
      std::int64_t s = 1;
      for (int d = rank - 1; d >= 0; --d) {
        v.strides[d] = s;
        s *= v.shape[d] > 0 ? v.shape[d] : 1;
      }
    }
    v.data = const_cast<void*>(a.data());
    return v;
  }

  dtype dtype_of(nb::dlpack::dtype t, const char* what) const {
    using code = nb::dlpack::dtype_code;
    if (t.lanes == 1) {
      const auto c = static_cast<code>(t.code);
      if (c == code::Float && t.bits == 32) return dtype::f32;
      if (c == code::Float && t.bits == 16) return dtype::f16;
      if (c == code::Bfloat && t.bits == 16) return dtype::bf16;
      if (c == code::Float8_E4M3FN && t.bits == 8) return dtype::f8_e4m3;
      if (c == code::Int && t.bits == 32) return dtype::i32;
    }
    detail::throw_invalid(where_, std::string(what) + " has dtype " + dlpack_dtype_name(t) +
                                      ", which moerunner does not take (f32, f16, bf16, f8_e4m3 or i32)");
  }

  memory_space space_of(const nb::ndarray<>& a, const char* what) {
    switch (a.device_type()) {
      case nb::device::cpu::value:
      case nb::device::cuda_host::value:  // pinned host memory
        return memory_space::host;
      case nb::device::cuda::value:
      case nb::device::cuda_managed::value: {
        const int id = static_cast<int>(a.device_id());
        if (device_ < 0) device_ = id;
        MOE_EXPECT(id == device_, where_,
                   std::string(what) + " is on CUDA device " + std::to_string(id) +
                       ", the call's other device tensors on device " + std::to_string(device_));
        return memory_space::device;
      }
      default:
        detail::throw_invalid(where_, std::string(what) + " lives on DLPack device type " +
                                          std::to_string(a.device_type()) + "; moerunner takes host and CUDA memory");
    }
  }

  const char* where_;
  int device_ = -1;
};

}  // namespace moerunner::python

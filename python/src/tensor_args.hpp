// DLPack arrays (torch, CuPy, JAX, numpy) as the library's tensor_views: dtype, shape, element
// strides, memory space and pointer taken as they are, so that the library's own checks judge
// them. Only what a tensor_view cannot describe is refused here.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/ndarray.h>

#include "dlpack_exchange.hpp"
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

// One array argument as DLPack describes it, valid while the call runs.
struct dl_array {
  nb::dlpack::dtype type;
  std::int32_t device_type = 0, device_id = 0;
  int rank = 0;
  const std::int64_t* shape = nullptr;
  const std::int64_t* strides = nullptr;  // in elements; null: row-major
  void* data = nullptr;                   // the first element (DLPack's byte offset applied)

  // Host memory, pinned included; CUDA device memory, managed included. Neither: refused.
  bool on_host() const { return device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value; }
  bool on_cuda_device() const {
    return device_type == nb::device::cuda::value || device_type == nb::device::cuda_managed::value;
  }
};

// Converts a call's array arguments, checking that its device tensors share one device, and
// finds the stream a call without one runs on. An array whose type carries DLPack's C exchange
// API (torch) is read through it, with no Python call; any other goes through nanobind's
// ndarray (`__dlpack__`, the buffer protocol), which is held until the call returns.
class tensor_args {
 public:
  explicit tensor_args(const char* where) : where_(where) {}

  // An array argument; None is refused as any other non-array.
  tensor_view operator()(nb::handle a, const char* what) { return view(import(a, what), what); }

  // An array argument the call writes (an output): as operator(), and refused when read-only.
  tensor_view written(nb::handle a, const char* what) { return view(import(a, what, true), what); }

  // An optional array argument: None is an empty view, which the library reads as "not given".
  tensor_view optional(nb::handle a, const char* what) { return a.is_none() ? tensor_view{} : (*this)(a, what); }

  // A byte buffer (the workspace): any dtype of whole bytes, dense and row-major, in `expected`
  // memory; its pointer and size in bytes. The view is typed as the 1-byte f8_e4m3 only for the
  // library's checks of space and layout, which count shape and strides in elements. None: no
  // workspace.
  workspace_view bytes(nb::handle a, memory_space expected, const char* what) {
    if (a.is_none()) return {};
    const dl_array d = import(a, what, true);
    const std::size_t bits = static_cast<std::size_t>(d.type.bits) * d.type.lanes;
    MOE_EXPECT(bits % 8 == 0, where_, std::string(what) + " has dtype " + dlpack_dtype_name(d.type) + ", not whole bytes");
    const tensor_view v = view_as(d, dtype::f8_e4m3, what);
    check::space(v, expected, where_, what);
    check::contiguous(v, where_, what);
    return {v.data, static_cast<std::size_t>(v.numel()) * (bits / 8)};
  }

  // The two steps of operator(), for a caller whose messages depend on where an array lives:
  // the array as DLPack describes it, then its view (messages from here on name `where`).
  // Arrays are taken read-only (memory-mapped or frozen numpy arrays are inputs like any
  // other); `writes` refuses a read-only one.
  dl_array import(nb::handle a, const char* what, bool writes = false);  // defined below the class
  tensor_view view(const dl_array& a, const char* what) { return view_as(a, dtype_of(a.type, what), what); }
  void set_where(const char* where) { where_ = where; }

  // The CUDA device of the device tensors, -1 when every tensor is on the host.
  int device() const { return device_; }

  // The cudaStream_t to run on. An int is taken as it is; None is the current stream of the
  // framework the device tensors came from (through its exchange API where it has one) and 0
  // for host tensors; moerunner._arrays.stream_handle(s, like) resolves the rest (stream
  // objects, frameworks without the API) in Python. Call after every array has been converted.
  std::uintptr_t stream(nb::handle s, nb::handle like) const {
    if (PyLong_CheckExact(s.ptr())) return stream_handle(s);
    if (s.is_none() && device_ < 0) return 0;
    if (s.is_none() && stream_api_ != nullptr && stream_api_->current_work_stream != nullptr) {
      void* current = nullptr;
      if (stream_api_->current_work_stream(nb::device::cuda::value, device_, &current) != 0) {
        if (!PyErr_Occurred())
          PyErr_SetString(PyExc_RuntimeError, (std::string(where_) + ": the arrays' framework gave no current stream "
                                               "for CUDA device " + std::to_string(device_)).c_str());
        throw nb::python_error();
      }
      return reinterpret_cast<std::uintptr_t>(current);
    }
    return stream_handle(nb::module_::import_("moerunner._arrays").attr("stream_handle")(s, like));
  }

 private:
  // A BufferError naming the argument the framework would not export, with the first line of
  // the framework's reason (torch's carries a C++ backtrace after it).
  [[noreturn]] void refused_export(const char* what) const {
    std::string reason = "no reason given";
    if (PyErr_Occurred()) {
      const nb::python_error e;  // takes the error, clearing it
      reason = nb::str(e.value()).c_str();
      reason = reason.substr(0, reason.find('\n'));
    }
    PyErr_SetString(PyExc_BufferError,
                    (std::string(where_) + ": " + what + " could not be exported through DLPack: " + reason).c_str());
    throw nb::python_error();
  }

  // An int stream handle as a cudaStream_t; a negative or oversized int is a TypeError, as
  // any other stream argument that is not a stream.
  std::uintptr_t stream_handle(nb::handle s) const {
    std::uintptr_t handle = 0;
    if (!nb::try_cast(s, handle, false))
      throw nb::type_error((std::string(where_) + ": stream must be a cudaStream_t as a non-negative int, got " +
                            nb::repr(s).c_str()).c_str());
    return handle;
  }

  // The array as a view of elements of type `type`: shape, strides, space, pointer as they are.
  tensor_view view_as(const dl_array& a, dtype type, const char* what) {
    tensor_view v;
    v.type = type;
    v.space = space_of(a, what);
    if (auto problem = detail::tensor_shape_problem(v.type, v.space, a.rank, a.shape); !problem.empty())
      detail::throw_invalid(where_, std::string(what) + " " + problem);
    v.rank = a.rank;
    for (int d = 0; d < a.rank; ++d) v.shape[d] = a.shape[d];
    // Row-major strides where DLPack gives none, and for an array without elements, whose
    // strides address nothing and which frameworks report freely (numpy's export of an empty
    // array, for one).
    if (a.strides == nullptr || v.numel() == 0) {
      std::int64_t s = 1;
      for (int d = a.rank - 1; d >= 0; --d) {
        v.strides[d] = s;
        s *= v.shape[d] > 0 ? v.shape[d] : 1;
      }
    } else {
      for (int d = 0; d < a.rank; ++d) v.strides[d] = a.strides[d];
    }
    v.data = a.data;
    return v;
  }

  // Where a device tensor lives, checked against the call's other device tensors; the first
  // device tensor read through an exchange API names the framework whose stream None means.
  void note_device(const dl_array& a, const char* what, const dlpack_exchange_api* api) {
    if (!a.on_cuda_device()) return;
    if (device_ < 0) device_ = a.device_id;
    MOE_EXPECT(a.device_id == device_, where_,
               std::string(what) + " is on CUDA device " + std::to_string(a.device_id) +
                   ", the call's other device tensors on device " + std::to_string(device_));
    if (stream_api_ == nullptr) stream_api_ = api;
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

  memory_space space_of(const dl_array& a, const char* what) const {
    if (a.on_host()) return memory_space::host;
    if (a.on_cuda_device()) return memory_space::device;
    detail::throw_invalid(where_, std::string(what) + " lives on DLPack device type " + std::to_string(a.device_type) +
                                      "; moerunner takes host and CUDA memory");
  }

  const char* where_;
  int device_ = -1;
  const dlpack_exchange_api* stream_api_ = nullptr;
  std::vector<nb::ndarray<nb::ro>> held_;  // arrays nanobind imported, released when the call returns
};

inline dl_array tensor_args::import(nb::handle a, const char* what, bool writes) {
  dl_array d;
  if (const dlpack_exchange_api* api = exchange_api_of(Py_TYPE(a.ptr()))) {
    nb::dlpack::dltensor t;
    if (api->dltensor_from_py_object_no_sync(a.ptr(), &t) != 0) refused_export(what);
    d = {t.dtype, t.device.device_type, t.device.device_id, t.ndim, t.shape, t.strides,
         static_cast<char*>(t.data) + t.byte_offset};
    note_device(d, what, api);
    return d;
  }
  // One import on either success path: a written array as writable, any other as read-only; the
  // read-only import of a written array only tells a read-only array from a non-array.
  nb::ndarray<nb::ro> arr;
  if (nb::ndarray<> writable; writes && nb::try_cast(a, writable)) {
    arr = nb::ndarray<nb::ro>(writable);
  } else if (!nb::try_cast(a, arr)) {
    throw nb::type_error((std::string(where_) + ": " + what + " must be an array (DLPack or the buffer protocol), got " +
                          nb::inst_name(a).c_str()).c_str());
  } else {
    MOE_EXPECT(!writes, where_, std::string(what) + " is read-only, and the call writes it");
  }
  d = {arr.dtype(), arr.device_type(), arr.device_id(), static_cast<int>(arr.ndim()), arr.shape_ptr(),
       arr.stride_ptr(), const_cast<void*>(arr.data())};
  held_.push_back(std::move(arr));
  note_device(d, what, nullptr);
  return d;
}

}  // namespace moerunner::python

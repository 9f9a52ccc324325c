// A non-owning, runtime-typed tensor descriptor for the public API.
//
// cuda::std::mdspan is statically typed and statically ranked, which suits kernels
// but not an engine-facing API whose dtype is only known at run time. tensor_view
// carries dtype, shape, element strides and memory space, validates itself, and
// hands out a typed cuda::std::mdspan once the caller has checked the dtype.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda/std/mdspan>

#include "moerunner/core/dtype.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/limits.hpp"

namespace moerunner {

enum class memory_space : std::uint8_t { host, device };

// Empty for a value outside the enumerators (made by a cast), which validation rejects.
constexpr std::string_view memory_space_name(memory_space s) {
  switch (s) {
    case memory_space::host: return "host";
    case memory_space::device: return "device";
  }
  return {};
}

namespace detail {
// Why a view with this dtype, space, rank and shape cannot describe memory, or empty when it
// can: every dimension non-negative and the product of the dimensions (a zero one counted as 1)
// times the element size representable in int64 (hence in size_t), so that numel(), bytes()
// and every row-major stride are exact.
inline std::string tensor_shape_problem(dtype t, memory_space sp, int rank, const std::int64_t* dims) {
  if (dtype_size(t) == 0) return "has an unknown dtype (value " + std::to_string(static_cast<int>(t)) + ")";
  if (memory_space_name(sp).empty())
    return "has an unknown memory space (value " + std::to_string(static_cast<int>(sp)) + ")";
  if (rank < 0 || rank > max_tensor_rank)
    return "has rank " + std::to_string(rank) + ", outside [0, " + std::to_string(max_tensor_rank) + "]";
  for (int d = 0; d < rank; ++d)
    if (dims[d] < 0) return "dimension " + std::to_string(d) + " is negative (" + std::to_string(dims[d]) + ")";
  // Checked multiplication, not a division per dimension: this runs for every tensor of every
  // call, where divisions were most of the Python binding's own validation time.
  std::int64_t bytes = static_cast<std::int64_t>(dtype_size(t));
  for (int d = 0; d < rank; ++d) {
    const std::int64_t n = dims[d] > 0 ? dims[d] : 1;
    if (__builtin_mul_overflow(bytes, n, &bytes)) return "spans more bytes than int64 can count";
  }
  return {};
}
}  // namespace detail

struct tensor_view {
  void* data = nullptr;
  dtype type = dtype::f32;
  int rank = 0;
  std::array<std::int64_t, max_tensor_rank> shape{};
  std::array<std::int64_t, max_tensor_rank> strides{};  // in elements
  memory_space space = memory_space::host;

  // A row-major view; the usual way to describe an engine's contiguous tensor.
  static tensor_view contiguous(const void* ptr, dtype t, std::initializer_list<std::int64_t> dims,
                                memory_space where) {
    tensor_view v;
    v.data = const_cast<void*>(ptr);
    v.type = t;
    v.space = where;
    if (dims.size() > max_tensor_rank)
      detail::throw_invalid("tensor_view::contiguous", "rank above " + std::to_string(max_tensor_rank));
    v.rank = static_cast<int>(dims.size());
    int i = 0;
    for (std::int64_t d : dims) v.shape[i++] = d;
    if (auto problem = detail::tensor_shape_problem(t, where, v.rank, v.shape.data()); !problem.empty())
      detail::throw_invalid("tensor_view::contiguous", "a tensor of shape " + v.shape_string() + " " + problem);
    std::int64_t s = 1;
    for (int d = v.rank - 1; d >= 0; --d) {
      v.strides[d] = s;
      s *= v.shape[d];
    }
    return v;
  }

  bool empty_view() const { return data == nullptr && rank == 0; }
  std::int64_t size(int d) const { return shape[d]; }
  std::int64_t stride(int d) const { return strides[d]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= shape[d];
    return n;
  }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(type); }
  bool is_contiguous() const {
    std::int64_t s = 1;
    for (int d = rank - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != s) return false;
      s *= shape[d];
    }
    return true;
  }
  std::string shape_string() const {
    if (rank < 0 || rank > max_tensor_rank) return "(rank " + std::to_string(rank) + ")";
    std::string s = "[";
    for (int d = 0; d < rank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
    return s + "]";
  }

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }

  // Typed strided view; the caller has already checked dtype and rank.
  template <class T, std::size_t R>
  cuda::std::mdspan<T, cuda::std::dextents<std::int64_t, R>, cuda::std::layout_stride> as_mdspan() const {
    using ext = cuda::std::dextents<std::int64_t, R>;
    cuda::std::array<std::int64_t, R> e{}, st{};
    for (std::size_t d = 0; d < R; ++d) {
      e[d] = shape[d];
      st[d] = strides[d];
    }
    return {static_cast<T*>(data), cuda::std::layout_stride::mapping<ext>(ext(e), st)};
  }
};

// Checks shared by every entry point: `where` names the call, `what` the argument.
namespace check {

// A view built by hand may hold anything: checked before any size or stride is computed.
inline void well_formed(const tensor_view& t, const char* where, const char* what) {
  if (auto problem = detail::tensor_shape_problem(t.type, t.space, t.rank, t.shape.data()); !problem.empty())
    detail::throw_invalid(where, std::string(what) + " " + problem + ", got shape " + t.shape_string());
}

// Every validated tensor passes here first, so the rank check also checks the view is well formed.
inline void rank(const tensor_view& t, int r, const char* where, const char* what) {
  well_formed(t, where, what);
  MOE_EXPECT(t.rank == r, where,
             std::string(what) + " must have rank " + std::to_string(r) + ", got shape " + t.shape_string());
}

inline void dim(const tensor_view& t, int d, std::int64_t expected, const char* where, const char* what) {
  MOE_EXPECT(t.shape[d] == expected, where,
             std::string(what) + " dimension " + std::to_string(d) + " must be " + std::to_string(expected) +
                 ", got shape " + t.shape_string());
}

inline void type(const tensor_view& t, dtype expected, const char* where, const char* what) {
  MOE_EXPECT(t.type == expected, where,
             std::string(what) + " must be " + std::string(dtype_name(expected)) + ", got " +
                 std::string(dtype_name(t.type)));
}

inline void aligned(const tensor_view& t, std::size_t bytes, const char* where, const char* what) {
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(t.data) % bytes == 0, where,
             std::string(what) + " must be " + std::to_string(bytes) + "-byte aligned");
}

// Where a tensor lives and, on the host, that its elements are aligned: host code reads them
// through typed pointers. Device alignment is each GPU path's own (stricter) check.
inline void space(const tensor_view& t, memory_space expected, const char* where, const char* what) {
  MOE_EXPECT(t.space == expected, where,
             std::string(what) + " must live in " + std::string(memory_space_name(expected)) + " memory, got " +
                 std::string(memory_space_name(t.space)));
  if (expected == memory_space::host) {
    const std::size_t elem = dtype_size(t.type);  // 0 only for a dtype well_formed rejects
    MOE_EXPECT(elem == 0 || reinterpret_cast<std::uintptr_t>(t.data) % elem == 0, where,
               std::string(what) + " must be " + std::to_string(elem) + "-byte aligned (its " +
                   std::string(dtype_name(t.type)) + " elements are read in place)");
  }
}

inline void contiguous(const tensor_view& t, const char* where, const char* what) {
  MOE_EXPECT(t.is_contiguous(), where, std::string(what) + " must be contiguous (row-major)");
}

inline void non_null(const tensor_view& t, const char* where, const char* what) {
  MOE_EXPECT(t.data != nullptr || t.numel() == 0, where, std::string(what) + " has a null data pointer");
}

// Everything a dense row-major tensor argument needs: rank, dtype, space, layout, pointer.
inline void dense(const tensor_view& t, int r, dtype ty, memory_space sp, const char* where, const char* what) {
  rank(t, r, where, what);
  type(t, ty, where, what);
  space(t, sp, where, what);
  contiguous(t, where, what);
  non_null(t, where, what);
}

}  // namespace check
}  // namespace moerunner

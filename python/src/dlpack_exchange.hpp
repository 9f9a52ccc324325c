// DLPack's C exchange API (DLPack 1.3): a framework's array type may carry
// `__dlpack_c_exchange_api__`, a capsule named "dlpack_exchange_api" over a table of C functions
// that describe one of its arrays without a Python call (torch >= 2.11 does). An array argument
// then costs tens of nanoseconds instead of the microseconds of `__dlpack__()`, and the table
// also names the framework's current stream. Declared here from the DLPack specification, as
// nanobind declares DLTensor: the package needs no framework headers to build.
#pragma once

#include <cstdint>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace moerunner::python {

// The table, in the order and with the signatures of DLPack 1.3's DLPackExchangeAPI. Only
// dltensor_from_py_object_no_sync and current_work_stream are called; the others are kept as
// opaque pointers so that the layout matches.
struct dlpack_exchange_api {
  struct header_t {
    std::uint32_t major, minor;  // DLPackVersion
    header_t* prev_api;          // an older table, for a consumer of an older major version
  } header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // Fills `out` with a non-owning description of `py_object`, valid until control returns to
  // Python; 0, or -1 with a Python exception set. May be null.
  int (*dltensor_from_py_object_no_sync)(void* py_object, nanobind::dlpack::dltensor* out);
  // The framework's current stream of a device (torch.cuda.current_stream for torch); 0, or -1
  // with a Python exception set.
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out_stream);
};

inline constexpr std::uint32_t dlpack_exchange_major = 1;

// The exchange table a capsule holds when this package can call it (major version 1, a dltensor
// exporter), else null.
inline const dlpack_exchange_api* exchange_api_in(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dlpack_exchange_api")) return nullptr;
  const auto* api = static_cast<const dlpack_exchange_api*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  for (const auto* h = api ? &api->header : nullptr; h != nullptr; h = h->prev_api) {
    if (h->major == dlpack_exchange_major) {
      const auto* table = reinterpret_cast<const dlpack_exchange_api*>(h);
      return table->dltensor_from_py_object_no_sync != nullptr ? table : nullptr;
    }
  }
  return nullptr;
}

// The exchange table of `type` when it has one this package can call, else null. The attribute
// is looked up on the type as the specification says, through the interpreter's type attribute
// cache, so a lookup costs nanoseconds; an attribute that is not such a capsule reads as absent
// rather than as an error, and the array then goes through `__dlpack__` as any other. The last
// capsule read is remembered (per thread), so that the seven or more arrays of one call skip the
// capsule's two name comparisons: a capsule's name and pointer never change.
inline const dlpack_exchange_api* exchange_api_of(PyTypeObject* type) {
  static PyObject* const name = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* capsule = _PyType_LookupRef(type, name);  // a new reference
  const nanobind::object owner = nanobind::steal(capsule);
#else
  PyObject* capsule = _PyType_Lookup(type, name);  // borrowed
#endif
  if (capsule == nullptr) return nullptr;
  // The remembered capsule is held (a reference dropped only when another replaces it, never at
  // thread exit, which may come after the interpreter's end), so its address cannot be reused.
  thread_local PyObject* last_capsule = nullptr;
  thread_local const dlpack_exchange_api* last_api = nullptr;
  if (capsule == last_capsule) return last_api;
  const dlpack_exchange_api* api = exchange_api_in(capsule);
  Py_INCREF(capsule);
  Py_XDECREF(last_capsule);
  last_capsule = capsule;
  last_api = api;
  return api;
}

}  // namespace moerunner::python

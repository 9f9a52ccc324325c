"""A framework array type that offers DLPack's C exchange API (`__dlpack_c_exchange_api__`, as
torch does) over numpy arrays, written with ctypes so that the extension's fast import path is
tested where no such framework is installed. Each type records the calls its table receives."""

import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class Header(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev_api", ctypes.c_void_p)]


FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(DLTensor))
STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


class ExchangeAPI(ctypes.Structure):
    _fields_ = [("header", Header), ("managed_tensor_allocator", ctypes.c_void_p),
                ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
                ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                ("dltensor_from_py_object_no_sync", FROM_PY), ("current_work_stream", STREAM)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

CODES = {"f": 2, "i": 0, "u": 1}  # DLPack type codes of numpy kinds (bfloat16 is not in numpy)


def array_type(major=1, device=(1, 0), stream=0x5000, fail=False, with_dlpack=False):
    """A new array class over numpy arrays whose type carries an exchange table of DLPack
    `major` version. Its arrays report DLPack device `device` (type, id); the table's
    current_work_stream answers `stream`; fail: the exporter returns -1 without an error set.
    with_dlpack: the class also has __dlpack__/__dlpack_device__ (numpy's), the path a consumer
    takes when it cannot use the table. Calls are recorded in the class's `calls` list."""

    class Array:
        calls = []

        def __init__(self, a):
            self.a = np.asarray(a)
            self.shape = self.a.shape
            self._shape = (ctypes.c_int64 * max(1, self.a.ndim))(*self.a.shape)
            self._strides = (ctypes.c_int64 * max(1, self.a.ndim))(*(s // self.a.itemsize for s in self.a.strides))

        if with_dlpack:
            def __dlpack__(self, **kw):
                Array.calls.append(("__dlpack__",))
                return self.a.__dlpack__(**kw)

            def __dlpack_device__(self):
                return self.a.__dlpack_device__()

    def export(obj, out):
        Array.calls.append(("export",))
        if fail:
            return -1
        t = out.contents
        a = obj.a
        t.data = a.ctypes.data
        t.device = DLDevice(*device)
        t.ndim = a.ndim
        t.dtype = DLDataType(CODES[a.dtype.kind], a.dtype.itemsize * 8, 1)
        t.shape = ctypes.cast(obj._shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(obj._strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
        return 0

    def current_stream(device_type, device_id, out):
        Array.calls.append(("stream", device_type, device_id))
        out[0] = stream
        return 0

    api = ExchangeAPI()
    api.header = Header(major, 3, None)
    api.dltensor_from_py_object_no_sync = FROM_PY(export)
    api.current_work_stream = STREAM(current_stream)
    Array._api = api  # the table and its callbacks live as long as the class
    Array.__dlpack_c_exchange_api__ = _capsule_new(ctypes.addressof(api), b"dlpack_exchange_api", None)
    return Array

"""ggml's C structs and constants as the pinned ggml-py (0.10.1) lays them out: what the bindings
(`ggml_kernels`) and viasd's own kernels (`rowexact`, which reads tensors' fields by offset) share."""

from __future__ import annotations

import ctypes

# enum ggml_type values the loader may meet (the GGUF's tensor types use the same numbers)
F32, F16, BF16, I32 = 0, 1, 30, 26
GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME, GGML_MAX_N_THREADS = 4, 10, 64, 64, 512
_OBJECT_SIZE = 32  # sizeof(struct ggml_object)


class _Tensor(ctypes.Structure):  # struct ggml_tensor (ggml.h of ggml-py 0.10.1)
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]

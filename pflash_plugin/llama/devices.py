"""Free memory of llama.cpp's GPU devices (ggml-backend's device registry), for KV pool sizing."""
from __future__ import annotations

import ctypes
import os

import llama_cpp  # noqa: F401  (loads libggml under its SONAME first)

_GPU = 1  # GGML_BACKEND_DEVICE_TYPE_GPU


def _ggml() -> ctypes.CDLL:
    """The libggml instance libllama already loaded (the wheel's .so files are copies)."""
    lib = ctypes.CDLL("libggml.so.0", mode=os.RTLD_NOLOAD)
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    return lib


def gpu_free_bytes(main_gpu: int = 0) -> int | None:
    """Free bytes of the `main_gpu`-th GPU device, or None when llama.cpp has no GPU device."""
    lib = _ggml()
    gpus = [d for d in (lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count()))
            if lib.ggml_backend_dev_type(d) == _GPU]
    if not gpus:
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.ggml_backend_dev_memory(gpus[min(main_gpu, len(gpus) - 1)], ctypes.byref(free), ctypes.byref(total))
    return free.value

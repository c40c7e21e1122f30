"""llama.cpp's devices (ggml-backend's registry): free GPU memory for KV pool sizing, RPC servers added."""
from __future__ import annotations

import ctypes
import os

import llama_cpp  # loads libggml under its SONAME first

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
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_register.restype = None
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    return lib


_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)  # ggml_backend_rpc_add_server (ggml-rpc.h)
_rpc_added: set[str] = set()


def add_rpc_servers(endpoints: list[str]) -> None:
    """Register each RPC server's devices with ggml (as llama.cpp's own --rpc does), so that models
    loaded afterwards offload to them. Process-wide: an endpoint is added once."""
    if not llama_cpp.llama_supports_rpc():
        raise RuntimeError("this llama.cpp build has no RPC backend (rebuild llama-cpp-python with "
                           "CMAKE_ARGS=-DGGML_RPC=on)")
    lib = _ggml()
    rpc = lib.ggml_backend_reg_by_name(b"RPC")
    address = lib.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server") if rpc else None
    if not address:
        raise RuntimeError("this llama.cpp build's RPC backend cannot add servers")
    add_server = _ADD_SERVER(address)
    for endpoint in endpoints:
        if endpoint in _rpc_added:
            continue
        server = add_server(endpoint.encode())
        if not server or lib.ggml_backend_reg_dev_count(server) == 0:
            raise RuntimeError(f"no RPC server answered at {endpoint}")
        lib.ggml_backend_register(server)
        _rpc_added.add(endpoint)


def _gpus(lib: ctypes.CDLL) -> list[int]:
    return [d for d in (lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count()))
            if lib.ggml_backend_dev_type(d) == _GPU]


def gpu_count() -> int:
    """GPU devices llama.cpp sees (0 on a CPU-only build)."""
    return len(_gpus(_ggml()))


def gpus_split_rows() -> bool:
    """Whether every GPU's backend can split a model by rows (llama.cpp's split buffers, which
    --split_mode 2 needs); True without GPUs, where the split mode does nothing."""
    lib = _ggml()
    name = b"ggml_backend_split_buffer_type"
    return all(lib.ggml_backend_reg_get_proc_address(lib.ggml_backend_dev_backend_reg(gpu), name) for gpu in _gpus(lib))


def _free_bytes(lib: ctypes.CDLL, device: int) -> int:
    """A device's free memory; on a GPU, reading it opens a CUDA context there (about 0.5 GiB on an H200)."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
    return free.value


def gpus_free_bytes() -> list[int]:
    """Free bytes of each GPU device llama.cpp sees, in its order (empty on a CPU-only build);
    a context is opened on each of them."""
    lib = _ggml()
    return [_free_bytes(lib, gpu) for gpu in _gpus(lib)]


def gpu_free_bytes(main_gpu: int = 0) -> int | None:
    """Free bytes of the `main_gpu`-th GPU device (no other GPU is touched), or None when
    llama.cpp has no GPU device."""
    lib = _ggml()
    gpus = _gpus(lib)
    return _free_bytes(lib, gpus[min(main_gpu, len(gpus) - 1)]) if gpus else None

"""Builds the native scoring library against the ggml that llama-cpp-python installed.

The backend follows llama-cpp-python's own switch: CMAKE_ARGS with -DGGML_CUDA=on builds the CUDA
scorer (architectures from -DCMAKE_CUDA_ARCHITECTURES), -DGGML_HIP=on the HIP one (targets from
-DAMDGPU_TARGETS or -DGPU_TARGETS); otherwise CPU only. PFLASH_EXT_BACKEND=cpu|cuda|hip overrides.
The library links ggml-base by its SONAME, so at run time it binds to the copy libllama loaded.

    python ggml_ext/pflash_build.py OUTPUT.so     (setup.py's build_ext calls `build`)
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CPU_SOURCES = ["capture.cpp", "score_cpu.cpp", "sample_cpu.cpp", "mask_cpu.cpp", "log_filter.cpp"]
GPU_SOURCE = "score_gpu.cu"


def cmake_option(name: str) -> str | None:
    """The value of -D<name>=... (or -D<name>:TYPE=...) in CMAKE_ARGS."""
    for arg in shlex.split(os.environ.get("CMAKE_ARGS", "")):
        match = re.fullmatch(rf"-D{name}(?::\w+)?=(.*)", arg)
        if match:
            return match.group(1)
    return None


def backend() -> str:
    chosen = os.environ.get("PFLASH_EXT_BACKEND")
    if chosen:
        if chosen not in ("cpu", "cuda", "hip"):
            raise ValueError(f"PFLASH_EXT_BACKEND must be cpu, cuda or hip, not {chosen!r}")
        return chosen
    on = lambda value: (value or "").lower() in ("on", "1", "true", "yes")  # noqa: E731
    if on(cmake_option("GGML_CUDA")):
        return "cuda"
    if on(cmake_option("GGML_HIP")):
        return "hip"
    return "cpu"


def ggml_paths() -> tuple[Path, Path]:
    """llama-cpp-python's include and lib folders (its wheel installs ggml's headers and libraries)."""
    import llama_cpp

    package = Path(llama_cpp.__file__).resolve().parent
    include = package.parent / "include"
    lib = package / "lib"
    if not (include / "ggml-backend.h").exists() or not (lib / "libggml-base.so.0").exists():
        raise FileNotFoundError(f"ggml headers or libggml-base.so.0 not found beside {package}")
    return include, lib


def _run(cmd: list[str]) -> None:
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _accepted(cxx: str, flag: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cpp"
        probe.write_text("int main() { return 0; }\n")
        return subprocess.run([cxx, flag, str(probe), "-o", str(Path(tmp) / "p")], capture_output=True).returncode == 0


def _cpu_flags(cxx: str) -> list[str]:
    """-march=native (llama.cpp builds natively from source too) and OpenMP (ggml-cpu's runtime),
    where the compiler takes them."""
    return [flag for flag in ("-march=native", "-fopenmp") if _accepted(cxx, flag)]


def _cuda_arch_flags() -> list[str]:
    archs = cmake_option("CMAKE_CUDA_ARCHITECTURES") or "native"
    if archs in ("native", "all", "all-major"):
        return [f"-arch={archs}"]
    flags = []
    for arch in archs.replace(",", ";").split(";"):
        number = re.sub(r"-(real|virtual)$", "", arch.strip())
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
    return flags


def _hip_arch_flags() -> list[str]:
    targets = cmake_option("AMDGPU_TARGETS") or cmake_option("GPU_TARGETS") or ""
    return [f"--offload-arch={t}" for t in targets.replace(",", ";").split(";") if t.strip()]


def _cuda_lib_dir(nvcc: str) -> Path:
    """The folder of libcudart_static.a: beside CUDA_HOME, /usr/local/cuda, or nvcc's toolkit."""
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", str(Path(nvcc).resolve().parent.parent)]
    for home in filter(None, homes):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (Path(home) / sub / "libcudart_static.a").exists():
                return Path(home) / sub
    raise FileNotFoundError("libcudart_static.a not found: set CUDA_HOME to the CUDA toolkit")


def compile_gpu_object(kind: str, out: Path, extra: list[str] | None = None) -> list[str]:
    """Compiles score_gpu.cu for CUDA or HIP into `out`; returns the link flags it needs."""
    source = str(HERE / GPU_SOURCE)
    if kind == "cuda":
        nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        _run([nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", *_cuda_arch_flags(), *(extra or []),
              "-c", source, "-o", str(out)])
        # static runtime: nothing to find at run time; the driver's primary context is shared with ggml-cuda
        return [f"-L{_cuda_lib_dir(nvcc)}", "-lcudart_static", "-ldl", "-lpthread", "-lrt"]
    hipcc = shutil.which("hipcc") or "/opt/rocm/bin/hipcc"
    env_flags = shlex.split(os.environ.get("PFLASH_HIPCC_FLAGS", ""))
    _run([hipcc, "-O3", "-std=c++17", "-fPIC", *_hip_arch_flags(), *env_flags, *(extra or []),
          "-x", "hip", "-c", source, "-o", str(out)])
    rocm = Path(os.environ.get("ROCM_PATH", "/opt/rocm"))
    return [f"-L{rocm / 'lib'}", "-lamdhip64"]


def build(output: Path) -> str:
    """Compiles and links the library to `output`; returns the backend built."""
    kind = backend()
    include, lib = ggml_paths()
    cxx = os.environ.get("CXX", "g++")
    cpu_flags = _cpu_flags(cxx)
    flags = ["-std=c++17", "-O3", "-fPIC", "-Wall", *cpu_flags, f"-I{include}", f"-I{HERE}"]
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        objects, link = [], []
        if kind != "cpu":
            flags += ["-DPFX_GPU", f'-DPFX_GPU_BACKEND="{kind}"']
            gpu_object = Path(tmp) / "score_gpu.o"
            link = compile_gpu_object(kind, gpu_object)
            objects.append(str(gpu_object))
        for source in CPU_SOURCES:
            obj = Path(tmp) / (Path(source).stem + ".o")
            _run([cxx, *flags, "-c", str(HERE / source), "-o", str(obj)])
            objects.append(str(obj))
        # ggml-base by SONAME: the copy libllama already loaded is the one bound at run time
        rpaths = ["-Wl,-rpath,$ORIGIN/../llama_cpp/lib", f"-Wl,-rpath,{lib}"]
        _run([cxx, "-shared", "-o", str(output), *objects, f"-L{lib}", "-l:libggml-base.so.0", *rpaths, *link,
              "-pthread", *[f for f in cpu_flags if f == "-fopenmp"]])
    return kind


if __name__ == "__main__":
    print("built", build(Path(sys.argv[1])), "->", sys.argv[1])

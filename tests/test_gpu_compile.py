"""The GPU scorer's one source compiles for AMD (hipcc) and NVIDIA (nvcc) wherever the compiler is
installed (.ci/run installs Debian's hipcc), so neither path can rot unseen on CPU-only machines."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ggml_ext"))
import pflash_build as ggml_ext_build  # noqa: E402

DEBIAN_ROCM_BITCODE = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")


@pytest.mark.skipif(shutil.which("hipcc") is None, reason="hipcc not installed")
def test_hip_source_compiles_for_rdna_and_cdna(tmp_path, monkeypatch):
    # wave32 (RDNA2) and wave64 (CDNA2); Debian's ROCm 5.2 device libraries stop before gfx1100
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1030;gfx90a")
    monkeypatch.setenv("HIP_PLATFORM", "amd")
    if DEBIAN_ROCM_BITCODE.exists():
        monkeypatch.setenv("PFLASH_HIPCC_FLAGS", f"--rocm-device-lib-path={DEBIAN_ROCM_BITCODE}")
    out = tmp_path / "score_gpu.o"
    link = ggml_ext_build.compile_gpu_object("hip", out, ["-Werror"])
    symbols = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True, check=True).stdout
    assert "pfx_gpu_attention_mass" in symbols and "-lamdhip64" in link
    assert ggml_ext_build.backend() == "hip"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_source_compiles_for_hopper(tmp_path, monkeypatch):
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90")
    out = tmp_path / "score_gpu.o"
    ggml_ext_build.compile_gpu_object("cuda", out, ["-Werror", "all-warnings"])
    symbols = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True, check=True).stdout
    assert "pfx_gpu_attention_mass" in symbols
    assert ggml_ext_build.backend() == "cuda"

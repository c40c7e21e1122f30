"""Whether ggml's CUDA backend replays its decode graphs as CUDA graphs: off past 64 slots with flash
attention, where they hang.

Measured (bench/gpu/hang_diag.py, tree 94b4cb4, an H100; docs/deployment.md): one server with 128
slots, a KV stream each and flash attention, alone on the device, 128 clients x 2 greedy requests
answered about half, then its engine thread waited in llama_get_logits -> cudaStreamSynchronize for
good with the GPU at 100% (at 0193d94 too). The same load ran to the end with
GGML_CUDA_DISABLE_GRAPHS=1 (3,136 tok/s), with flash attention off (1,343 tok/s) and with
CUDA_LAUNCH_BLOCKING=1 (3,536 tok/s: CUDA graphs still on, each launch waited for); one unified KV
stream hung too. 64 slots ran clean on every run since the hang was first seen. So a kernel of the
captured 128-row step with flash attention never ends (the clean run with each launch waited for
suggests it needs the host to launch ahead of it); which kernel is not known (a suspect: ggml
launches kernels with programmatic dependent launch on Hopper, GGML_CUDA_PDL=0 turns it off).
ggml reads GGML_CUDA_DISABLE_GRAPHS once per process, at its first graph: the decision is the
process's, taken before any weights load (server/config/llama_params.bring_up).
"""
from __future__ import annotations

import os
from typing import Literal

DISABLE_ENV = "GGML_CUDA_DISABLE_GRAPHS"  # set at all (any value): ggml captures no CUDA graph
SAFE_SLOTS = 64  # the most slots measured clean with CUDA graphs and flash attention

Setting = Literal["auto", "on", "off"]


def graphs_off_reason(setting: Setting, n_slots: int, flash_attn: bool | None, on_gpu: bool) -> str | None:
    """Why CUDA graphs should be off for this model (None: leave them on). `flash_attn` None is
    llama.cpp's auto, which turns it on with a GPU."""
    if not on_gpu or setting == "on":
        return None
    if setting == "off":
        return "--cuda_graphs off"
    if n_slots > SAFE_SLOTS and flash_attn is not False:
        return (f"{n_slots} slots with flash attention: CUDA graphs hung past {SAFE_SLOTS} slots "
                "(docs/deployment.md; --cuda_graphs on keeps them)")
    return None


def disable_graphs() -> bool:
    """CUDA graphs off for this process (before its first decode); False where the environment
    had decided already (its GGML_CUDA_DISABLE_GRAPHS is kept)."""
    if DISABLE_ENV in os.environ:
        return False
    os.environ[DISABLE_ENV] = "1"
    return True

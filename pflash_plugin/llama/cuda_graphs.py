"""Whether ggml's CUDA backend replays its decode graphs as CUDA graphs: off from 32 slots with
flash attention, where servers with them aborted or hung under load.

Measured (docs/deployment.md): a 128-slot server, 128 clients x 2 greedy requests, hung with its
engine thread in llama_get_logits -> cudaStreamSynchronize and the GPU at 100% (bench/gpu/hang_diag.py,
H100 and H200); the same load ran to the end with GGML_CUDA_DISABLE_GRAPHS=1, with flash attention off
or with CUDA_LAUNCH_BLOCKING=1. At 32 slots under the online benchmark's load (long prompts beside
answers, 8 req/s; bench/gpu/online_gpu.py) servers with graphs failed in 5 of 6 runs at 50dc092 on an
H100 ("CUDA error: an illegal instruction was encountered" in cudaStreamSynchronize, or a hang), as
at 1f4ca1a (H100) and 8ada373 (H200), and **llama-server with its default graphs aborted the same way
in 3 of 3**; with graphs off, 5 of 5 ran to the end. So it is ggml's (at this pin), and the fewest
slots it was seen at is 32; below that no run failed (fewer were made). Graphs off cost a 32-slot
server 4% of its 1-client greedy decode and 9% at 32 clients (H100, one rep).
ggml reads GGML_CUDA_DISABLE_GRAPHS once per process, at its first graph: the decision is the
process's, taken before any weights load (server/config/llama_params.bring_up).
"""
from __future__ import annotations

import os
from typing import Literal

DISABLE_ENV = "GGML_CUDA_DISABLE_GRAPHS"  # set at all (any value): ggml captures no CUDA graph
FAILED_AT_SLOTS = 32  # the fewest slots where a server with CUDA graphs and flash attention failed

Setting = Literal["auto", "on", "off"]


def graphs_off_reason(setting: Setting, n_slots: int, flash_attn: bool | None, on_gpu: bool) -> str | None:
    """Why CUDA graphs should be off for this model (None: leave them on). `flash_attn` None is
    llama.cpp's auto, which turns it on with a GPU."""
    if not on_gpu or setting == "on":
        return None
    if setting == "off":
        return "--cuda_graphs off"
    if n_slots >= FAILED_AT_SLOTS and flash_attn is not False:
        return (f"{n_slots} slots with flash attention: ggml's CUDA graphs aborted or hung servers from "
                f"{FAILED_AT_SLOTS} slots under load (docs/deployment.md; --cuda_graphs on keeps them)")
    return None


def disable_graphs() -> bool:
    """CUDA graphs off for this process (before its first decode); False where the environment
    had decided already (its GGML_CUDA_DISABLE_GRAPHS is kept)."""
    if DISABLE_ENV in os.environ:
        return False
    os.environ[DISABLE_ENV] = "1"
    return True

"""Memory the drafter needs beside the resident target, so the KV pool leaves it free.

Per token the drafter holds its own KV (f16 K and V on every layer: its context is swa_full),
the captured Q/K of the scoring layers twice (per-ubatch chunks, then their concatenation), and
the float64 scores. Fixed: its compute buffer for one ubatch and, for a separate GGUF, its
weights. `tests/test_reserve.py` measures the peak resident memory of real drafter runs and
checks that this formula covers it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..llama import Model

CAPTURE_COPIES = 2
# Scores, softmax temporaries and the per-token Python objects of selection (piece strings, index
# lists). Measured on gemma-3-270m, CPU: peak RSS grows 31.8-32.2 KiB per prompt token, of which
# KV + captures are 28.7 KiB; 3.5 KiB rounded up to 6 KiB.
SCORING_BYTES_PER_TOKEN = 6 * 1024
# One ubatch's compute buffer and activations: measured intercept 25 MiB at n_batch 512 (49 KiB per
# ubatch token), rounded up.
COMPUTE_BYTES_PER_UBATCH_TOKEN = 64 * 1024
# On a GPU the drafter's context adds device buffers (compute, cuBLAS workspaces): measured on an
# H200 (bench/gpu/probe.py, 12-layer 1024-wide model) as a 128 MiB intercept, rounded up.
GPU_FIXED_BYTES = 192 * 2**20


@dataclass(frozen=True)
class Reserve:
    fixed_bytes: int
    per_token_bytes: int  # captures and scoring: every prompt token
    kv_bytes_per_token: int  # the drafter's KV: every cell of its context

    def bytes_for(self, n_tokens: int, kv_tokens: int | None = None) -> int:
        """Peak for prompts of `n_tokens`, the drafter context holding `kv_tokens` cells (all of
        them for one causal pass; sink + window when drafting in windows)."""
        kv = n_tokens if kv_tokens is None else kv_tokens
        return self.fixed_bytes + self.per_token_bytes * n_tokens + self.kv_bytes_per_token * kv


def drafter_reserve(model: Model, layers: list[int], n_batch: int, separate_weights: bool,
                    gpu: bool = False, lanes: int = 1, lane_cells: int = 0) -> Reserve:
    """Lanes (DraftOptions.lanes) beyond the first each add a context: its compute buffers and
    `lane_cells` KV cells (their captures land in the first one's)."""
    capture = CAPTURE_COPIES * 4 * len(layers) * (model.n_head + model.n_head_kv) * model.head_dim()
    context = context_bytes(model, n_batch, 0, gpu)
    fixed = context + (lanes - 1) * context_bytes(model, n_batch, lane_cells, gpu) + \
        (model.size_bytes if separate_weights else 0)
    return Reserve(fixed, capture + SCORING_BYTES_PER_TOKEN, model.kv_bytes_per_token())


def context_bytes(model: Model, n_batch: int, cells: int, gpu: bool) -> int:
    """A llama.cpp context of `model` (its weights apart): compute buffers for an n_batch ubatch
    and `cells` KV cells. A speculative draft model's context is sized so too (its weights added
    where they are loaded for it alone)."""
    compute = COMPUTE_BYTES_PER_UBATCH_TOKEN * n_batch + (GPU_FIXED_BYTES if gpu else 0)
    return compute + model.kv_bytes_per_token() * cells


def available_memory_bytes() -> int:
    """Host memory the kernel says can be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not found in /proc/meminfo")

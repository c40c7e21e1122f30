"""Where llama.cpp puts a model's layers across GPUs, so that the KV pool counts only the share of
its cache that lands on the GPU which also holds the PFlash drafter (`main_gpu`)."""
from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import llama_cpp.llama_cpp as C

from .model import ModelParams


def layer_devices(n_layer: int, n_gpu_layers: int, splits: list[float]) -> list[int | None]:
    """The GPU of each repeating layer (None: the CPU) when a model is split by layers: llama.cpp's
    rule (llama-model.cpp, load_tensors). The last `n_gpu_layers` of the n_layer + 1 layers (the
    output layer counts) go to the GPUs in proportion to `splits`: tensor_split, or else each
    GPU's free memory."""
    total = sum(splits)
    if total <= 0:
        raise ValueError("splits must have a positive sum")
    bounds = [s / total for s in accumulate(splits)]
    offloaded = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    first = n_layer + 1 - offloaded
    if not offloaded:
        return [None] * n_layer
    return [None if il < first else min(bisect_right(bounds, (il - first) / offloaded), len(splits) - 1)
            for il in range(n_layer)]


def splits_by_free_memory(params: ModelParams, n_gpus: int) -> bool:
    """Whether llama.cpp spreads this model's layers by each GPU's free memory (split by layers over
    several GPUs, no tensor_split): only then does kv_share_on_main_gpu need every GPU's free
    memory, whose reading opens a CUDA context on each GPU."""
    return params.split_mode == C.LLAMA_SPLIT_MODE_LAYER and n_gpus > 1 and not any(params.tensor_split or ())


def kv_share_on_main_gpu(params: ModelParams, n_layer: int, n_gpus: int, free_at_load: list[int]) -> float:
    """Fraction of the model's KV cache (one cache per layer, on its layer's device) on
    `params.main_gpu`. Only a split by layers spreads it: a single GPU holds all of it, and with a
    split by rows or tensors the share is taken as all of it (the safe side for the drafter's
    reserve). `free_at_load`: each GPU's free memory before the load, where splits_by_free_memory."""
    if params.split_mode != C.LLAMA_SPLIT_MODE_LAYER or n_gpus < 2:
        return 1.0
    if splits_by_free_memory(params, n_gpus):
        splits = [float(free) for free in free_at_load]
    else:
        given = list(params.tensor_split or ())[:n_gpus]
        splits = given + [0.0] * (n_gpus - len(given))
    devices = layer_devices(n_layer, params.n_gpu_layers, splits)
    return sum(device == params.main_gpu for device in devices) / n_layer

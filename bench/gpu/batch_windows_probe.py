"""Where side by side windows go wrong: the K rows a drafter captures with K windows per batch against
one window at a time, window by window (on CUDA, K = 4 scored 0.33 off at 64K and right at 16K).

    python bench/gpu/batch_windows_probe.py --model D10.gguf --layers 9 --tokens 65536 --k 2 4 --out p.json

Per window: its round (windows are drafted K at a time after the first), its sequence in the round
(the KV stream), and the largest difference of its captured K rows over the largest K value. A fault
that starts at one round or stream, or grows with the rounds, shows in the table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pflash_plugin.llama import Model
from pflash_plugin.pflash.drafter import DraftOptions, Drafter
from pflash_plugin.pflash.windows import DraftWindows

import numpy as np  # after llama_cpp (see pflash_gpu.py)


def captured_k(model: Model, layer: int, tokens: list[int], k: int, sink: int) -> np.ndarray:
    drafter = Drafter(model, [layer], len(tokens), DraftOptions(windows=DraftWindows(2048, sink, causal_max=0),
                                                                batch_windows=k))
    try:
        drafter.run(tokens, len(tokens) - 8)
        return drafter.scorer.tensors(layer)[1].copy()
    finally:
        drafter.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, nargs=1, required=True)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--n_gpu_layers", type=int, default=-1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = Model(args.model, n_gpu_layers=args.n_gpu_layers)
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, model.n_vocab, args.tokens)]
    layer = args.layers[0]
    serial = captured_k(model, layer, tokens, 1, args.sink)
    scale = float(np.abs(serial).max())
    first, *rest = DraftWindows(2048, args.sink, causal_max=0).stages(len(tokens) - 8)
    result = {}
    for k in args.k:
        side = captured_k(model, layer, tokens, k, args.sink)
        windows = [{"window": 0, "round": -1, "seq": 0,
                    "k_diff": float(np.abs(side[:first.end] - serial[:first.end]).max() / scale)}]
        for i, stage in enumerate(rest):
            end = min(stage.end, len(serial))
            windows.append({"window": i + 1, "round": i // k, "seq": i % k,
                            "k_diff": float(np.abs(side[stage.start:end] - serial[stage.start:end]).max() / scale)})
        result[k] = windows
        worst = max(windows, key=lambda w: w["k_diff"])
        print(json.dumps({"k": k, "worst": worst, "rounds_over_1e-2": sorted({w["round"] for w in windows
                                                                              if w["k_diff"] > 1e-2})}), flush=True)
    args.out.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "windows": result}, indent=1))
    model.close()


if __name__ == "__main__":
    main()

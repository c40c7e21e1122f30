"""Whether an aborted llama_decode (a step cut for a newcomer: engine/stepping.py) changes what the next
decode writes: a batch of two sequences' chunks is aborted at the Nth abort poll (llama.cpp removes
the aborted ubatch's cells; this script removes every cell), then one sequence's prompt is prefilled
and read back by the logits of one probe token, against the same prefill in a fresh context; then
the same once more in the aborted context. On the CPU (tiny model, F32 weights, F16 KV) the first
prefill after an abort in the first sequence's ubatch reads 3.6e-4 off on logits of ~10, the one
after it exact: a residue of the abort inside llama.cpp/ggml, not of the scheduler (the cells it
keeps are counted right: tests/test_steady_properties.py). On a GPU run it with --model and a GPU
layer count to see whether the device shows it too.

    python bench/abort_residue.py [--model PATH] [--n_gpu_layers N]
"""
from __future__ import annotations

import argparse
import random
from typing import Any

import numpy as np

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.llama import DecodeError, ModelParams


def prefill(runner: Any, rows: list[tuple[int, list[int]]]) -> None:
    runner.batch.clear()
    for seq, tokens in rows:
        runner.batch.add_sequence(tokens, 0, seq, False)
    runner.ctx.decode(runner.batch)


def probe(runner: Any, seq: int, n_tokens: int, token: int = 42) -> np.ndarray:
    """The logits of one token after the sequence's cells (then removed)."""
    runner.batch.clear()
    runner.batch.add_sequence([token], n_tokens, seq, True)
    runner.ctx.decode(runner.batch)
    logits = runner.ctx.logits(0).copy()
    runner.ctx.memory.seq_rm(seq, n_tokens, -1)
    return logits


def run(args: argparse.Namespace, polls: int, a: list[int], b: list[int]) -> list[np.ndarray]:
    """Abort a batch of `a` (seq 0) and part of `b` (seq 3) at the `polls`th poll (0: no abort),
    then prefill `b` alone twice, each read back."""
    config = EngineConfig(n_slots=4, max_ctx=128, kv_layout="per_slot", n_batch=32, n_ubatch=8, n_threads=1,
                          n_threads_batch=1, backend_sampling="off", model=ModelParams(n_gpu_layers=args.n_gpu_layers))
    model, engine = load_engine(args.model, config)
    engine.stop()
    runner: Any = engine.runner  # the LlamaRunner (the engine's Runner seam has no context)
    ctx, seen = runner.ctx, [0]
    try:
        if polls:
            def abort() -> bool:
                seen[0] += 1
                return seen[0] >= polls

            ctx.set_abort(abort)
            ctx.arm_abort(True)
            try:
                prefill(runner, [(0, a), (3, b[:19])])
            except DecodeError as error:
                assert error.code == 2
            ctx.arm_abort(False)
        out = []
        for _ in range(2):
            for seq in range(4):
                ctx.memory.seq_rm(seq, 0, -1)
            prefill(runner, [(3, b)])
            out.append(probe(runner, 3, len(b)))
        return out
    finally:
        engine.close()
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF (default: the tiny test model)")
    parser.add_argument("--n_gpu_layers", type=int, default=0)
    args = parser.parse_args()
    if args.model is None:
        from pflash_plugin.testing import cached_tiny_llama
        args.model = str(cached_tiny_llama())
    rng = random.Random(5)
    a, b = [rng.randrange(10, 400) for _ in range(13)], [rng.randrange(10, 400) for _ in range(31)]
    clean = run(args, 0, a, b)[0]
    for polls in (1, 5, 20, 100):
        first, second = run(args, polls, a, b)
        print(f"abort at poll {polls:3d}: first prefill after it {np.abs(first - clean).max():.2e}, "
              f"the next {np.abs(second - clean).max():.2e} (max |logit difference|)")


if __name__ == "__main__":
    main()

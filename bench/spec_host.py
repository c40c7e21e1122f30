"""What prompt lookup costs the host per decode step at a large batch (issue 47), on any machine.

At 64-128 clients on a GPU the host's Python between steps bounds the step rate, and random weights
accept no draft: every microsecond speculation spends there is lost. This drives the engine in this
process on the tiny generated model (2 layers, width 64: its decode is next to nothing, so the
host's work is what a step costs), `--rows` requests together, greedy, `min_tokens` = `max_tokens`
so every row decodes to the end; arms interleaved per rep:
  off      no speculation;
  lookup   `--draft_model prompt-lookup-decoding` (the default policy: max_rows 16);
  rejected the same, each draft token replaced by the next id (the lookup's work done, nothing
           accepted: random weights on a GPU);
  judged   rejected with max_rows raised to the batch, so that only the adaptive policy's
           judgement (acceptance against the measured step cost) keeps drafting off.
Per arm: milliseconds a step (wall / decode steps), and the seconds spent inside the engine's
speculation calls (Speculation.drafts, started, verified: timed by wrapping them), per step;
drafted and accepted tokens. Medians over reps. First, what verifying one greedy row whose first
draft is rejected costs at `--vocab` tokens (engine/speculation/verifier.py, random logits), by its
number of drafts: the tiny model's 1,341-token vocabulary hides that part.

    python bench/spec_host.py [--rows 64 128] [--reps 5] [--tokens 96] [--out FILE]

On the H200 (a line of bench/gpu/queue.sh's queue: bench/gpu/servers.sh passes --target, --drafter
and --llama-server; the last two are not used): `bench/spec_host.py --n_gpu_layers -1 --threads 0
--rows 16 64 128 --reps 3 --out /tmp/queue/spec_host_h200.json`: the random-weight target is
loaded once, each arm's engine built on it and closed after.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import llama_cpp  # noqa: F401, I001  before numpy: numpy first made the CUDA model load segfault on the H200 machine
import numpy as np
from harness import REPO, machine, run_to_end
from pflash_plugin.engine.loader import EngineConfig, build_engine, load_model
from pflash_plugin.llama import Model, ModelParams
from pflash_plugin.engine.request import Request, SamplingParams, TokenOutput
from pflash_plugin.engine.speculation.drafting import Speculation
from pflash_plugin.engine.speculation.setup import PROMPT_LOOKUP, SpeculationConfig
from pflash_plugin.engine.speculation.verifier import Verifier
from pflash_plugin.engine.stats import SpeculationStats
from pflash_plugin.testing import cached_tiny_llama

ARMS = ("off", "lookup", "rejected", "judged")


class Timed:
    """Seconds spent in a Speculation's per-step calls (wrapped on the instance)."""

    def __init__(self, spec: Speculation) -> None:
        self.seconds, self.steps = 0.0, 0
        for name in ("drafts", "started", "verified"):
            setattr(spec, name, self._wrap(getattr(spec, name)))

    def _wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.steps += call.__name__ == "started"
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def reject(spec: Speculation, n_vocab: int) -> None:
    """The proposer's drafts made wrong: each token the next id, so the target keeps none."""
    propose = spec.proposer.propose

    def wrong(rows: Any) -> list[list[int]]:
        return [[(t + 1) % n_vocab for t in draft] for draft in propose(rows)]
    spec.proposer.propose = wrong  # type: ignore[method-assign]


def one(model: Model, base: EngineConfig, arm: str, rows: int, tokens: int) -> dict:
    """One arm's run: `rows` requests of `tokens` tokens submitted together, on an engine of its own."""
    spec = None if arm == "off" else SpeculationConfig(PROMPT_LOOKUP, max_rows=rows if arm == "judged" else 16)
    engine = build_engine(model, dataclasses.replace(base, n_slots=rows, speculation=spec))
    try:
        speculation = engine.scheduler.steps.speculation
        if speculation is not None and arm in ("rejected", "judged"):
            reject(speculation, model.n_vocab)
        timed = Timed(speculation) if speculation is not None else None
        requests = [Request(model.tokenize(f"prompt {i} about the weather, the weather, the weather"),
                            SamplingParams(max_tokens=tokens, temperature=0.0, min_tokens=tokens)) for i in range(rows)]
        wall = run_to_end(engine, requests, 600)
        stats = engine.scheduler.steps.speculation_stats()
        steps = timed.steps if timed else max(len(r.output_tokens) for r in requests)  # +1: the prefill's step
        return {"arm": arm, "rows": rows, "steps": steps, "tok_s": round(rows * tokens / wall, 1),
                "ms_per_step": round(1e3 * wall / steps, 4),
                "spec_us_per_step": round(1e6 * timed.seconds / steps, 2) if timed else 0.0,
                "drafted": stats.drafted if stats else 0, "accepted": stats.accepted if stats else 0,
                **budget(stats)}
    finally:
        engine.stop()
        engine.close()


def budget(stats: SpeculationStats | None) -> dict[str, float]:
    """Where speculation's step time went (speculation/budget.py): steps with drafts, the plain steps
    after them, the other plain steps (count, ms), probes, and the drafts' unpaid ms."""
    if stats is None:
        return {}
    return {"draft_steps": stats.draft_steps, "draft_ms": round(1e3 * stats.draft_step_seconds, 2),
            "settle_steps": stats.settle_steps, "settle_ms": round(1e3 * stats.settle_step_seconds, 2),
            "plain_steps": stats.plain_steps, "plain_ms": round(1e3 * stats.plain_step_seconds, 2),
            "probes": stats.probes, "excess_ms": round(1e3 * stats.excess_seconds, 2),
            "unpaid_ms": round(1e3 * stats.unpaid_seconds, 2)}


@dataclass
class _Bound:
    request: Request
    params: SamplingParams
    chain: None
    rng: np.random.Generator


def verify_us(vocab: int, drafts: int, reps: int = 200) -> float:
    """Microseconds the Verifier takes for one greedy row whose first of `drafts` drafts is rejected,
    at `vocab` tokens (random logits: what random weights give), the median of `reps` batches of 10."""
    logits = np.random.default_rng(0).standard_normal((drafts + 2, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    request = Request([1], params)
    request.output_tokens = [1]
    wrong = (int(logits[1].argmax()) + 1) % vocab
    rows = {request.request_id: (_Bound(request, params, None, np.random.default_rng(0)),
                                 [(j, j) for j in range(1, drafts + 2)])}
    verifier: Verifier[_Bound] = Verifier(lambda: [0], lambda bound, row: TokenOutput(0))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(10):
            verifier.verify(logits, rows, {request.request_id: [wrong] * drafts})
        times.append((time.perf_counter() - start) / 10)
    return round(1e6 * statistics.median(times), 1)


def summary(runs: list[dict], rows: list[int]) -> list[dict]:
    out = []
    for n in rows:
        for arm in ARMS:
            mine = [r for r in runs if r["rows"] == n and r["arm"] == arm]
            out.append({"rows": n, "arm": arm, "tok_s": round(statistics.median(r["tok_s"] for r in mine), 1),
                        "ms_per_step": round(statistics.median(r["ms_per_step"] for r in mine), 4),
                        "spec_us_per_step": round(statistics.median(r["spec_us_per_step"] for r in mine), 2),
                        "drafted": sum(r["drafted"] for r in mine), "accepted": sum(r["accepted"] for r in mine),
                        **{k: sum(r.get(k, 0) for r in mine) for k in ("probes", "draft_steps", "unpaid_ms")}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "spec_host.json")
    parser.add_argument("--vocab", type=int, default=128_341, help="the verification's vocabulary (the H200 runs')")
    parser.add_argument("--target", help="the model's GGUF (default: the tiny generated model)")
    parser.add_argument("--n_gpu_layers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="n_threads and n_threads_batch (0: llama.cpp's)")
    parser.add_argument("--drafter", help=argparse.SUPPRESS)  # bench/gpu/servers.sh's, not used
    parser.add_argument("--llama-server", help=argparse.SUPPRESS)
    args = parser.parse_args()
    load = os.getloadavg()
    verify = {k: verify_us(args.vocab, k) for k in (1, 3, 10)}
    print("verify one rejected row, us by drafts:", verify, flush=True)
    base = EngineConfig(max_ctx=512, n_threads=args.threads, n_threads_batch=args.threads,
                        flash_attn=args.n_gpu_layers != 0, model=ModelParams(n_gpu_layers=args.n_gpu_layers))
    model = load_model(args.target or cached_tiny_llama(), base)
    runs = []
    for arm in ARMS:  # warm-up: the first context, the page cache
        one(model, base, arm, min(args.rows), 8)
    for rep in range(args.reps):
        for n in args.rows:
            for arm in ARMS if rep % 2 == 0 else reversed(ARMS):
                runs.append({"rep": rep, **one(model, base, arm, n, args.tokens)})
                print(json.dumps(runs[-1]), flush=True)
    tree = os.environ.get("PFLASH_TREE") or subprocess.run(  # the device's copy has no git: queue.sh passes it
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"summary": summary(runs, args.rows), "verify_us_by_drafts": verify, "vocab": args.vocab,
              "model": args.target or "tiny", "runs": runs, "tokens": args.tokens, "reps": args.reps,
              "load_at_start": load, "load_at_end": os.getloadavg(), "tree": tree, "machine": machine(),
              "config": dataclasses.asdict(SpeculationConfig(PROMPT_LOOKUP))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    for row in result["summary"]:
        print(row)


if __name__ == "__main__":
    main()

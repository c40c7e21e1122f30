"""The online benchmark's sweep, shared by the CPU (bench/online.py) and the GPU (bench/gpu/online_gpu.py):
arms (a server and the fields its requests carry), rates swept with the arms side by side at each
rate (their order rotated each rep), reps outermost so that a budget cut keeps whole reps; the
results file is rewritten after every run."""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from harness import ServerProcess
from online_data import Item
from online_load import Objective, record, run_point, summarize


@dataclass
class Arm:
    """A column of the benchmark. `force` makes every request generate its output length: `min_tokens`
    (ours, llama_cpp.server), `ignore_eos` (llama-server) or `logit_bias` (the upstream example server,
    which knows neither: the end-of-generation tokens get -100)."""

    label: str
    server: ServerProcess
    force: str
    fields: dict[str, Any] = field(default_factory=dict)
    eog: tuple[int, ...] = ()

    def body(self, item: Item) -> bytes:
        request: dict[str, Any] = {"prompt": item.prompt, "max_tokens": item.output_tokens, "temperature": 0,
                                   "repeat_penalty": 1.0, "stream": True, **self.fields}
        if self.force == "min_tokens":
            request["min_tokens"] = item.output_tokens
        elif self.force == "ignore_eos":
            request["ignore_eos"] = True
        else:
            request["logit_bias"] = {str(token): -100 for token in self.eog}
        return json.dumps(request).encode()


def eog_tokens(model_path: str) -> tuple[int, ...]:
    """The model's end-of-generation tokens (its vocabulary only)."""
    from pflash_plugin.llama.model import Model

    return tuple(Model(model_path, vocab_only=True).eog_tokens)


def wait_idle(arm: Arm, timeout_s: float) -> float | None:
    """A 1-token request, answered once the server has finished what the cut requests left: the
    seconds it took, None if not within `timeout_s`."""
    start = time.perf_counter()
    body = json.loads(arm.body(Item("Hello", 1, 1, "probe")))
    body["stream"] = False
    try:
        httpx.post(arm.server.url + "/v1/completions", json=body, timeout=timeout_s).raise_for_status()
    except httpx.HTTPError:
        return None
    return time.perf_counter() - start


def settle(arm: Arm, timeout_s: float) -> tuple[float, bool]:
    """Wait until the server is idle; one still busy after `timeout_s` (a serial server works through
    every request whose client left, a prefill each) is started afresh. Returns (seconds, restarted)."""
    start = time.perf_counter()
    if wait_idle(arm, timeout_s) is not None:
        return time.perf_counter() - start, False
    arm.server.restart(900)
    wait_idle(arm, 300.0)
    return time.perf_counter() - start, True


@dataclass
class Sweep:
    """What a sweep runs: `items(rate, rep, arm_index)` gives a run's requests, `limit_s(last_offset)`
    how long a run may take; the sweep stops starting runs after `budget_s`."""

    arms: list[Arm]
    rates: list[float]
    reps: int
    items: Callable[[float, int, int], list[Item]]
    objective: Objective
    limit_s: Callable[[float], float]
    out: Path
    meta: dict[str, Any]
    budget_s: float = float("inf")
    settle_s: float = 30.0  # a server not idle this long after a run is restarted (settle)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def write(self, complete: bool) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        data = {**self.meta, "objective": self.objective.__dict__, "rates": self.rates, "reps": self.reps,
                "arms": [a.label for a in self.arms], "complete": complete, "runs": self.rows}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.out)

    def run(self, say: Callable[[str], None]) -> None:
        """Every (arm, rate, rep) not among `rows` yet (a sweep cut by its budget goes on where it stopped)."""
        start = time.perf_counter()
        done = {(row["arm"], row["rate"], row["rep"]) for row in self.rows}
        for rep in range(self.reps):
            for rate in self.rates:
                order = self.arms[rep % len(self.arms):] + self.arms[:rep % len(self.arms)]
                for arm in (a for a in order if (a.label, rate, rep) not in done):
                    if time.perf_counter() - start > self.budget_s:
                        say(f"budget of {self.budget_s:.0f} s spent: stopping before rep {rep} rate {rate} {arm.label}")
                        self.write(complete=False)
                        return
                    self.rows.append(self.one(arm, rate, rep, say))
                    self.write(complete=False)
        self.write(complete=True)

    def one(self, arm: Arm, rate: float, rep: int, say: Callable[[str], None]) -> dict[str, Any]:
        items = self.items(rate, rep, self.arms.index(arm))
        bodies = [arm.body(item) for item in items]
        seed = 1000 * rep + int(rate * 100)
        from online_load import arrivals  # the same offsets run_point draws, for the limit

        limit = self.limit_s(arrivals(len(items), rate, seed)[-1])
        outcomes, duration = asyncio.run(run_point(arm.server.url, items, bodies, rate, seed, limit))
        summary = summarize(outcomes, duration, self.objective)
        idle_s, restarted = settle(arm, self.settle_s)
        say(f"rep {rep} rate {rate:g} {arm.label:16s} done {summary['completed']}/{summary['requests']} "
            f"goodput {summary['goodput']:.3f} TTFT p50/p99 {summary['median_ttft_s']}/{summary['p99_ttft_s']} s "
            f"ITL p99 {summary['p99_itl_s']} s out {summary['output_throughput']} tok/s (idle after {idle_s:.1f} s"
            f"{', restarted' if restarted else ''})")
        return {"arm": arm.label, "rate": rate, "rep": rep, "limit_s": round(limit, 1), "idle_after_s": round(idle_s, 2),
                "restarted": restarted,
                "load": os.getloadavg(), **summary, "requests_detail": [record(o) for o in outcomes]}

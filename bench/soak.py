"""Soak benchmark: a long mixed workload on the demo model; nothing may be lost, hang or get a 5xx.

One server (harness.ServerProcess) serves two models from a config file: the demo model ("demo":
PFlash auto with a threshold under the long prompts, 4 slots) and a tiny generated model ("tiny":
routing, and a real 404 for unknown names), with an API key. pflash_plugin.testing.soak sends the
requests (every kind: short and long, streamed or not, PFlash off/auto/always per request, cancels
mid-stream and before the first byte, clients that time out, malformed JSON, wrong types,
over-long prompts, unknown models, no key, oversized bodies) in two halves; the server's resident
memory (/proc/PID/status VmRSS) is sampled throughout. Afterwards /status must show every model
idle (no request, no busy slot, no KV page beyond the cached prefixes).

Then (--fuzz_examples N, 0 to skip) schemathesis sends up to N generated requests per operation of
the server's OpenAPI schema to a second server with one tiny model (one model: any generated model
name reaches it); none may get a 5xx or go unanswered.

With --hostile N, N more ordinary requests, then N with issue 22's hostile kinds among them
(costly grammars and schemas, deep JSON, stop lists): the ordinary kinds' p99 latency in each.

Usage: python bench/soak.py [--requests 500] [--concurrency 8] [--fuzz_examples 300] [--hostile 0] [--out bench/results/soak.json]
Prints a markdown summary; docs/soak.md quotes a run.
"""
from __future__ import annotations

import os
import sys

# `python bench/soak.py` puts bench/ first on sys.path: move it last (see bench/serving.py).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

from harness import REPO, ServerProcess, demo_model_path
from serving import code_state, host_info

from pflash_plugin.testing import cached_tiny_llama
from pflash_plugin.testing.fuzz import fuzz
from pflash_plugin.testing.soak import (
    FAILURES,
    HOSTILE,
    Workload,
    abandoned_tail,
    plan,
    run,
    summarize,
    wait_idle,
)

API_KEY = "soak-bench-key"


class MemorySampler:
    """VmRSS of one process every `period_s`, on a thread; `mark()` starts a new phase."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        self.pid, self.period_s = pid, period_s
        self.phases: list[list[int]] = [[]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak) in KiB."""
        fields = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
        return fields

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.phases[-1].append(self.read()["VmRSS"])

    def start(self) -> "MemorySampler":
        self.phases[-1].append(self.read()["VmRSS"])
        self._thread.start()
        return self

    def mark(self) -> None:
        self.phases.append([self.read()["VmRSS"]])

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        last = self.read()
        self.phases[-1].append(last["VmRSS"])
        return {
            "at_start_mib": _mib(self.phases[0][0]),
            "phases": [{"peak_mib": _mib(max(p)), "end_mib": _mib(p[-1]), "samples": len(p)} for p in self.phases],
            "hwm_mib": _mib(last["VmHWM"]),
        }


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


def config(args: argparse.Namespace, path: Path, port: int) -> Path:
    """The server's config file (with a config file, the server reads its port there, not from --port)."""
    demo = {"model": demo_model_path(), "model_alias": "demo", "n_ctx": args.n_ctx, "max_concurrency": 4, "max_queue": 64,
            "pflash": "auto", "pflash_threshold": args.pflash_threshold, "pflash_keep_ratio": 0.25, "verbose": False}
    tiny = {"model": str(cached_tiny_llama()), "model_alias": "tiny", "n_ctx": 512, "max_concurrency": 2, "max_queue": 64,
            "n_threads": 1, "n_threads_batch": 1, "verbose": False}
    path.write_text(json.dumps({"host": "127.0.0.1", "port": port, "api_key": API_KEY, "models": [demo, tiny]}))
    return path


async def soak(w: Workload, n: int, seed: int, memory: MemorySampler) -> tuple[list, float, dict, dict]:
    kinds = plan(n, seed)
    half = len(kinds) // 2
    t0 = time.perf_counter()
    outcomes = await run(w, kinds[:half], seed)
    memory.mark()
    outcomes += await run(w, kinds[half:], seed, first_index=half)
    wall = time.perf_counter() - t0
    idle_s, problems, status = await wait_idle(w)
    after = {"idle_after_s": round(idle_s, 2), "not_idle": problems}
    after["abandoned_tail"] = await abandoned_tail(w, 12, seed, max_tokens=2000)
    return outcomes, wall, after, status


async def hostile_mix(w: Workload, n: int, seed: int) -> dict:
    """`n` requests of the ordinary kinds, then `n` with issue 22's hostile kinds among them: the
    ordinary kinds' median and p99 latency in each, what failed, and the pool idle after."""
    clean = summarize(await run(w, plan(n, seed), seed, first_index=2 * 10**6))
    mixed = summarize(await run(w, plan(n, seed, hostile=True), seed, first_index=3 * 10**6))
    idle_s, problems, _ = await wait_idle(w)
    return {"requests": n, "clean": clean["normal_ok_seconds"], "hostile": mixed["normal_ok_seconds"],
            "failures": mixed["failures"], "by_kind": {k: v for k, v in mixed["by_kind"].items() if k in HOSTILE},
            "idle_after_s": round(idle_s, 2), "not_idle": problems}


def run_fuzz(max_examples: int) -> dict:
    server = ServerProcess("fuzz", ["--model", str(cached_tiny_llama()), "--model_alias", "tiny", "--n_ctx", "256",
                                    "--max_concurrency", "2", "--n_threads", "1", "--n_threads_batch", "1", "--api_key", API_KEY], ready_paths=("/health",))
    server.start()
    try:
        t0 = time.perf_counter()
        sent, findings = fuzz(server.url, max_examples, headers={"Authorization": f"Bearer {API_KEY}"}, timeout_s=60)
        return {"max_examples": max_examples, "sent": sent, "seconds": round(time.perf_counter() - t0, 1),
                "findings": [f.__dict__ for f in findings]}
    finally:
        server.stop()


def markdown(result: dict) -> str:
    s, mem, after = result["summary"], result["memory"], result["after"]
    first, second = mem["phases"]
    lines = [
        "| requests | wall (s) | lost | hung | 5xx | stream errors | unexpected | pool idle after (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {s['requests']} | {result['wall_s']:.0f} | " + " | ".join(str(s["failures"][f]) for f in FAILURES)
        + f" | {after['idle_after_s'] if not after['not_idle'] else 'NOT IDLE: ' + json.dumps(after['not_idle'])} |",
        "",
        "| kind | ok | rejected (expected 4xx) | abandoned by the client | failures |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for kind, counts in s["by_kind"].items():
        failed = sum(counts.get(f, 0) for f in FAILURES)
        lines.append(f"| {kind} | {counts.get('ok', 0)} | {counts.get('rejected', 0)} | {counts.get('abandoned', 0)} | {failed} |")
    lines += [
        "",
        f"Server RSS (MiB): {mem['at_start_mib']} after loading; first half peak {first['peak_mib']} (end {first['end_mib']}), "
        f"second half peak {second['peak_mib']} (end {second['end_mib']}); VmHWM {mem['hwm_mib']}. "
        f"PFlash compressed {s['pflash_compressed']} prompts. Median ok request {s['ok_seconds']['median']:.2f} s, "
        f"slowest {s['ok_seconds']['max']:.1f} s.",
    ]
    tail = after["abandoned_tail"]
    lines.append(f"\nThen {tail['requests']} clients that leave early ({tail['results']}) from requests of max_tokens "
                 f"{tail['max_tokens']}: the pool idle {tail['idle_after_s']} s after the last one left"
                 + (f", NOT IDLE: {json.dumps(tail['not_idle'])}" if tail["not_idle"] else "") + ".")
    if result.get("hostile"):
        h = result["hostile"]
        lines.append(f"\nHostile mix ({h['requests']} requests, issue 22's shapes among the ordinary kinds): the "
                     f"ordinary kinds' median/p99 {h['hostile']['median']:.2f}/{h['hostile']['p99']:.2f} s against "
                     f"{h['clean']['median']:.2f}/{h['clean']['p99']:.2f} s in a clean run of as many; failures "
                     f"{json.dumps(h['failures'])}; hostile kinds {json.dumps(h['by_kind'])}; pool idle "
                     f"{h['idle_after_s']} s after" + (f", NOT IDLE: {json.dumps(h['not_idle'])}" if h["not_idle"] else "")
                     + ".")
    if result.get("fuzz"):
        f = result["fuzz"]
        lines.append(f"\nFuzz: {f['sent']} generated requests (up to {f['max_examples']} per operation) in {f['seconds']} s: "
                     f"{len(f['findings'])} server errors or unanswered.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8, help="clients at a time")
    parser.add_argument("--n_ctx", type=int, default=4096)
    parser.add_argument("--pflash_threshold", type=int, default=1024)
    parser.add_argument("--long_words", type=int, default=1200, help="words of a long prompt (~1.3 tokens each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuzz_examples", type=int, default=300, help="per operation; 0: no fuzz")
    parser.add_argument("--hostile", type=int, default=0,
                        help="then this many ordinary requests, and as many with hostile kinds among them; 0: skip")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess("soak", [], ready_paths=("/health",))
        server.args = ["--config_file", str(config(args, Path(tmp) / "soak.json", server.port))]
        code = code_state()
        server.start(timeout_s=300)
        try:
            workload = Workload(server.url, "demo", "tiny", long_words=args.long_words, over_long_words=args.n_ctx,
                                api_key=API_KEY, concurrency=args.concurrency, deadline_s=180)
            memory = MemorySampler(server.proc.pid).start()
            outcomes, wall, after, status = asyncio.run(soak(workload, args.requests, args.seed, memory))
            result = {"machine": host_info(), "code": code, "args": {k: str(v) for k, v in vars(args).items()},
                      "wall_s": wall, "summary": summarize(outcomes), "after": after, "memory": memory.stop(),
                      "status_after": status}
            if args.hostile:
                result["hostile"] = asyncio.run(hostile_mix(workload, args.hostile, args.seed))
        finally:
            server.stop()
    result["fuzz"] = run_fuzz(args.fuzz_examples) if args.fuzz_examples else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=repr))
    print(markdown(result))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()

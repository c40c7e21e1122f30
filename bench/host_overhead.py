"""The host's cost per decode step at 64 slots: the engine alone against the same engine behind HTTP.

On a GPU a decode step of 64 slots takes a few milliseconds of device time, so the Python around
it (scheduling, sampling calls, detokenization, handing events to the event loop, JSON) decides
how close the server gets to llama-server. This bench shows that cost on any machine: a tiny
model (a 2-layer generated GGUF, whose decode is cheap) with 64 slots, 64 clients x 128 tokens,
greedy, `min_tokens` 128 so that every request runs to the end.

Arms, interleaved per rep: the engine driven in this process (no HTTP: the ceiling), timed per
step (its wall time, llama_decode's, and the host's rest: the host ms per step), then each server
non-streamed and streamed. `--baseline REV` adds the engine and a server of another git revision
(a temporary worktree; its engine runs in a child process), for before/after comparisons in one
run. `--vocab-extra 127000` gives the tiny model a 128,341-token vocabulary (the H200 benches'
`VOCAB_EXTRA`): the logits' host work (the argmax over 64 x 128K floats) then shows. `--model
demo` runs the demo model instead (a 262K-token vocabulary), with `--slots` clients of `--tokens`
tokens. `--engine-only` runs the engine arms alone.

    python bench/host_overhead.py [--reps 5] [--baseline HEAD~1] [--vocab-extra 127000] [--engine-only]

Writes bench/results/host_overhead.json and docs/host_overhead.md (docs/host_overhead_128k.md with
a 128K vocabulary, docs/host_overhead_demo.md for the demo model).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from harness import REPO, ServerProcess, demo_model_path, machine, run_to_end
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.testing import cached_tiny_llama

MODELS = {"tiny": "the tiny generated model (2 layers, width 64, a 1,341-token vocabulary), whose decode is cheap so "
                  "that the host's work shows",
          "demo": "the demo model (Gemma 3 270M Q4_K_M, a 262,144-token vocabulary)"}
DOCS = {"tiny": "host_overhead.md", "demo": "host_overhead_demo.md"}  # --temperature > 0 adds "_sampled"



def server_flags(args: argparse.Namespace) -> list[str]:
    return ["--max_concurrency", str(args.slots), "--n_ctx", "512", "--n_threads", "1", "--n_threads_batch", "1",
            "--verbose", "false"]


# The engine's parts timed per step (exclusive of the parts they call): (what, object path, method).
# "wait": the collect blocked on the device's outputs (llama_get_logits, the first device-sampled token
# and llama_synchronize wait for the decode on a GPU; on the CPU the decode has ended inside
# llama_decode, so it is ~0 there).
PHASES = (("plan", "scheduler", "schedule"), ("batch", "runner", "launch"), ("decode", "runner.ctx", "decode"),
          ("sample", "runner", "collect"), ("wait", "runner.ctx", "output_logits"),
          ("wait", "runner.ctx", "sampled_token"), ("wait", "runner.ctx", "synchronize"),
          ("take", "scheduler", "update"), ("text", "scheduler", "release_text"),
          ("emit", "scheduler", "emit"), ("stats", "published", "stats_now"), ("activity", "published", "activity_now"))


class PhaseTimer:
    """Wraps the engine's parts (PHASES) so each call's time counts for its phase less the time of
    the wrapped parts it calls (launch less the decode it runs: the batch; update less the text it
    releases: taking the tokens). Only the engine thread calls them."""

    def __init__(self, engine: object) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[float] = []  # per open call, the time its wrapped callees took
        for phase, owner, method in PHASES:
            target = engine
            for name in owner.split("."):
                target = getattr(target, name)
            if hasattr(target, method):  # an older tree may lack one
                setattr(target, method, self._wrap(phase, getattr(target, method)))

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                inner = self._stack.pop()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + spent - inner
                if self._stack:
                    self._stack[-1] += spent
        return timed

    def per_step(self, steps: int, wall_s: float) -> dict[str, float]:
        """Each part's ms per step over `steps` steps of `wall_s` seconds, and "other": the rest of the
        step (the engine loop's own: its inbox, admission's messages, the step's hooks)."""
        parts = {phase: 1000 * seconds / steps for phase, seconds in self.seconds.items()}
        parts["other"] = 1000 * wall_s / steps - sum(parts.values())
        return parts


def banned(args: argparse.Namespace) -> dict[int, float]:
    """The logit_bias every request sends: `--ban` tokens at -100 (clients ban byte tokens so, as
    bench/vision.py does; each row's bias is gathered by the host's sampler every step)."""
    return {token: -100.0 for token in range(3, 3 + args.ban)}


def engine_alone(model_path: Path, args: argparse.Namespace) -> dict:
    """The engine in this process (requests submitted together, sinks that count): tokens/s, and
    per step its wall ms, llama_decode's ms (on the CPU the decode runs inside the call), the
    host's rest (`host_ms`) and that rest by part (`phases_ms`: PHASES, "other" the engine loop's
    own); `outputs`, a hash of every request's tokens (greedy: the same in every tree)."""
    config = EngineConfig(n_slots=args.slots, max_ctx=512, n_threads=1, n_threads_batch=1)
    model, engine = load_engine(model_path, config)
    timer = PhaseTimer(engine)
    try:
        requests = [Request(model.tokenize(f"prompt {i} about the weather"),
                            SamplingParams(max_tokens=args.tokens, temperature=args.temperature, min_tokens=args.tokens,
                                           logit_bias=banned(args)))
                    for i in range(args.slots)]
        steps = engine.steps
        wall = run_to_end(engine, requests, 600)
        steps = engine.steps - steps
    finally:
        engine.stop()
    per_step = timer.per_step(steps, wall)
    decode = per_step.pop("decode", 0.0)
    host = 1000 * wall / steps - decode
    return {"tok_s": round(sum(len(r.output_tokens) for r in requests) / wall), "steps": steps,
            "step_ms": round(1000 * wall / steps, 3), "decode_ms": round(decode, 3), "host_ms": round(host, 3),
            "phases_ms": {phase: round(ms, 3) for phase, ms in per_step.items()},
            "outputs": hash(tuple(tuple(r.output_tokens) for r in requests)) if args.temperature == 0 else None}


def engine_in(tree: Path, model_path: Path, args: argparse.Namespace) -> dict:
    """`engine_alone` on another tree's code, in a child process (its pflash_plugin first on the path;
    the native library copied in by `worktree`)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--engine-arm", str(model_path), "--slots", str(args.slots),
            "--tokens", str(args.tokens), "--temperature", str(args.temperature), "--ban", str(args.ban)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _one(client: httpx.AsyncClient, i: int, args: argparse.Namespace, stream: bool) -> int:
    body = {"prompt": f"prompt {i} about the weather", "max_tokens": args.tokens, "temperature": args.temperature,
            "min_tokens": args.tokens, "stream": stream, "logit_bias": {str(t): b for t, b in banned(args).items()}}
    if not stream:
        return (await client.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"]
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            chunks += line.startswith('data: {"')
    return chunks - 1  # the last chunk carries the finish reason, no token


async def _clients(url: str, args: argparse.Namespace, stream: bool) -> float:
    limits = httpx.Limits(max_connections=2 * args.slots)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(_one(client, i, args, stream) for i in range(args.slots))))
        return tokens / (time.perf_counter() - start)


def worktree(rev: str) -> Path:
    """A temporary checkout of `rev` (a baseline arm's tree), with this checkout's native library
    (ignored by git: a tree without it runs the Python fallbacks); `remove_worktree` takes it away.
    `rev` may be a `git archive --format=tar.gz REV pflash_plugin` saved as NAME.tgz instead (the GPU
    machine has no git history)."""
    path = Path(tempfile.mkdtemp(prefix="pflash-baseline-"))
    if rev.endswith(".tgz"):
        subprocess.run(["tar", "xzf", str(Path(rev).resolve()), "-C", str(path)], check=True)
    else:
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True)
    for built in (REPO / "pflash_plugin").glob("_pflash_ext*"):
        shutil.copy2(built, path / "pflash_plugin" / built.name)
    return path


def remove_worktree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    shutil.rmtree(tree, ignore_errors=True)


def model_path(args: argparse.Namespace) -> Path:
    if args.model == "demo":
        return Path(demo_model_path())
    return cached_tiny_llama(vocab_extra=args.vocab_extra) if args.vocab_extra else cached_tiny_llama()


def run(args: argparse.Namespace) -> dict:
    at_start = machine()
    model = model_path(args)
    flags = ["--model", str(model), *server_flags(args)]
    servers = {} if args.engine_only else {"this": ServerProcess("host-this", flags)}
    tree = worktree(args.baseline) if args.baseline else None
    if tree is not None and not args.engine_only:
        servers[args.baseline] = ServerProcess("host-baseline", flags, cwd=tree)
    rows: list[dict] = []
    try:
        for server in servers.values():
            server.start()
            asyncio.run(_clients(server.url, args, False))  # warm-up
        for rep in range(args.reps):
            engines = [("engine alone", lambda: engine_alone(model, args))]
            if tree is not None:
                engines.append((f"{args.baseline}, engine alone", lambda: engine_in(tree, model, args)))
            for arm, measure in engines[:: 1 if rep % 2 == 0 else -1]:  # each first in turn
                rows.append({"arm": arm, "rep": rep, **measure()})
                print(json.dumps(rows[-1]), flush=True)
            for name, server in list(servers.items())[:: 1 if rep % 2 == 0 else -1]:  # each first in turn
                for stream in (False, True):
                    arm = f"{name}, {'streamed' if stream else 'non-streamed'}"
                    rows.append({"arm": arm, "rep": rep, "tok_s": round(asyncio.run(_clients(server.url, args, stream)))})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
        if tree is not None:
            remove_worktree(tree)
    this_tree = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                               text=True).stdout.strip() or os.environ.get("PFLASH_TREE", "unknown")
    return {"rows": rows, "machine": at_start, "tree": this_tree, "load_at_end": os.getloadavg(), "clients": args.slots,
            "tokens": args.tokens, "baseline": args.baseline, "model": args.model, "temperature": args.temperature,
            "vocab_extra": args.vocab_extra, "ban": args.ban}


def doc_name(result: dict) -> str:
    name = DOCS[result["model"]]
    if result.get("vocab_extra"):
        name = name.replace(".md", f"_{(1341 + result['vocab_extra']) // 1000}k.md")
    if result.get("ban"):
        name = name.replace(".md", f"_ban{result['ban']}.md")
    return name.replace(".md", "_sampled.md") if result.get("temperature") else name


def model_words(result: dict) -> str:
    if result["model"] == "tiny" and result.get("vocab_extra"):
        return (f"the tiny generated model (2 layers, width 64) with a {1341 + result['vocab_extra']:,}-token "
                "vocabulary (`--vocab-extra`), so that the logits' host work shows beside the rest")
    return MODELS[result["model"]]


def step_table(result: dict) -> list[str]:
    """Per step, the engine alone: wall, llama_decode and the host's rest (medians; per rep)."""
    rows = [r for r in result["rows"] if "host_ms" in r]
    lines = ["| engine | tokens/s | ms per step | llama_decode ms | host ms per step | host ms per rep |",
             "|---|---:|---:|---:|---:|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in mine)

        lines.append(f"| {arm} | {med('tok_s'):,.0f} | {med('step_ms'):.2f} | {med('decode_ms'):.2f} | "
                     f"**{med('host_ms'):.2f}** | {', '.join(format(r['host_ms'], '.2f') for r in mine)} |")
    phased = [r for r in rows if r.get("phases_ms")]
    if phased:
        arms = list(dict.fromkeys(r["arm"] for r in phased))
        lines += ["", "The host's ms per step by part (medians; each part less the parts it calls): plan "
                  "(Scheduler.schedule: admission, the step's rows), batch (the runner's launch less llama_decode), "
                  "sample (the runner's collect less its wait), take (Scheduler.update: the tokens into their requests), text "
                  "(release_text: detokenizing, stop strings), emit (the sinks), stats (the published stats), activity "
                  "(what background work is told, before each step), wait (the collect blocked on the device: ~0 on "
                  "the CPU), other (the engine loop's own: its inbox, admission's messages, the step's hooks).", "",
                  "| part | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
        parts = list(dict.fromkeys(k for r in phased for k in r["phases_ms"]))
        for part in parts:
            cells = [statistics.median(r["phases_ms"].get(part, 0.0) for r in phased if r["arm"] == arm) for arm in arms]
            lines.append(f"| {part} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    hashes = {r.get("outputs") for r in rows}
    if result["temperature"] == 0 and len(rows) > 1:
        lines += ["", f"Greedy tokens the same in every engine run: {len(hashes) == 1}."]
    return lines


def write_docs(result: dict, command: str) -> None:
    arms = list(dict.fromkeys(r["arm"] for r in result["rows"]))
    ceiling = statistics.median(r["tok_s"] for r in result["rows"] if r["arm"] == "engine alone")
    lines = ["# Host overhead per decode step: the engine alone and behind HTTP", "",
             f"{result['clients']} slots, {result['clients']} clients x {result['tokens']} tokens (temperature "
             f"{result['temperature']}, `min_tokens` = `max_tokens`"
             + (f", {result['ban']} tokens banned by `logit_bias` in each" if result.get("ban") else "")
             + f"), {model_words(result)} on 1 decode thread. "
             "Medians over reps; "
             f"arms interleaved per rep, each first in turn. This tree: {result.get('tree', 'unknown')}"
             + (f"; the baseline: {result['baseline']}." if result.get("baseline") else "."),
             "", "## Per step, the engine alone", "",
             "The host's ms per step is the step's wall time less llama_decode's (on the CPU the decode runs "
             "inside the call): planning the step, the batch, sampling, the tokens' bookkeeping, text and events. "
             "On a GPU the decode returns while the device computes, and the text and events go out beside it.", "",
             *step_table(result), "", "## Tokens/s, the engine alone and behind HTTP", "",
             f"| arm | tokens/s | ms per step of {result['clients']} tokens | of the engine alone | per rep |",
             "|---|---:|---:|---:|---|"]
    for arm in arms:
        values = [r["tok_s"] for r in result["rows"] if r["arm"] == arm]
        median = statistics.median(values)
        lines.append(f"| {arm} | {median:,.0f} | {1000 * result['clients'] / median:.1f} | {median / ceiling:.0%} "
                     f"| {', '.join(f'{v:,}' for v in values)} |")
    m = result["machine"]
    load = ", ".join(f"{x:.2f}" for x in m["load_at_start"])
    lines += ["", f"Machine: {m['nproc']} cores, {m['cpu']}, load (`uptime`) at start {load}, at the end "
              f"{', '.join(f'{x:.2f}' for x in result.get('load_at_end', ()))}. The clients run "
              "on the same cores as the server.", "", f"Command: `{command}`", ""]
    (REPO / "docs" / doc_name(result)).write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--slots", type=int, default=64, help="slots, and clients sent at once")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per client")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above 0, llama_cpp.server's other sampling defaults (top-k 40, ...)")
    parser.add_argument("--baseline", help="a git revision whose engine and server run beside this one")
    parser.add_argument("--vocab-extra", dest="vocab_extra", type=int, default=0,
                        help="tokens added to the tiny model's 1,341 (127000: the H200 benches' 128K vocabulary)")
    parser.add_argument("--ban", type=int, default=0,
                        help="each request bans this many tokens by logit_bias -100 (ids 3..; bench/vision.py bans 256)")
    parser.add_argument("--engine-only", dest="engine_only", action="store_true", help="the engine arms alone")
    parser.add_argument("--engine-arm", dest="engine_arm", type=Path, help=argparse.SUPPRESS)  # engine_in's child
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "host_overhead.json")
    args = parser.parse_args()
    if args.engine_arm:
        print(json.dumps(engine_alone(args.engine_arm, args)))
        return
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    command = "python bench/host_overhead.py " + " ".join(sys.argv[1:])
    write_docs(result, command.strip())
    print((REPO / "docs" / doc_name(result)).read_text())


if __name__ == "__main__":
    main()

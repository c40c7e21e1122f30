"""mix8's short requests on the CPU: where their first token's time goes between the client and the
engine (issue 48, item 4).

mix8 on the H200 sends 4 long prompts and 4 short streamed ones at once; the short ones' first token
reached the client 0.04 s after the engine made it. Here the same shape on 2 CPU cores, with the
tiny generated model (its decode is cheap, so the host's path shows) and 8 slots (`--slots`; no short
request queues for a slot): 4 long bodies sent first, then 4 short streamed ones, at once. Workloads:
- `ids`: mix8's own bodies, /v1/completions with 22,528 token ids each (about 130 KB of JSON);
- `chat`: /v1/chat/completions with `--long_chars` characters of chat content each.
The long requests run until every short one has finished, then are cancelled (their prefill is not
what is measured) and the server is left to go idle before the next arm. Per short request: the
client's time to the response's headers and to its first text, and the server's `timings`:
`prepare_ms` (its headers reaching the server to its engine arrival: body read and parsed, prompt
prepared), `ttft_ms` (engine arrival to first token), `release_ms` (first token to its event leaving
the engine thread), `emit_ms` (that to its text handed to the socket), where the server reports
them. `gap_ms` is the client's TTFT less the engine's (the part issue 48 is about); `outside_ms` is
what of it the marks leave (the client's sending, the server's accepting and reading the headers,
the client's reading); `in_ms` and `out_ms` split it where the server reports its marks on the host's
clock (`--usage_clock`, this tree's arm): the sending to the server's `received` mark (the client's
sending, the server's accepting and reading the headers), and its text written to the client's parse.
`queue_ms`: of the engine's TTFT, the wait for its admission (the engine drains its inbox between steps).
Arm `floor` (bench/asgi_floor.py) is the least an ASGI app on uvicorn does for the same requests
(reads and parses the body, streams a chunk at once): the client's, the kernel's and uvicorn's share.
`--baseline REV` runs a server of another git revision (a temporary worktree) beside this tree's,
arms interleaved per rep, order alternating; `--ours_arms NAME=FLAGS` this tree's with more flags. The servers decode on 1 thread (`--n_threads 1`): the
other core is the HTTP side's, as a GPU host's cores are.
`--steps gpu` gives the servers the H200's step shape (`--n_batch 2048 --n_ubatch 512 --prefill_chunk
2048`: a long prompt's chunk takes the whole step beside the decode rows, 4 ubatches, as with no cap
on a GPU; the tiny model's first such steps take 75-190 ms on one core, the H200's 40-60 ms) and
`--slots 4` mix8's slots (a short request gets one from a long prompt that lends it): the engine's
part of the short requests' TTFT, which a step in flight sets (step_policy.py's preemption).
`--short_gap_ms G` sends the short requests G ms apart rather than at once: the later ones then
arrive while the earlier ones decode beside a long chunk (an online load's arrivals, not mix8's).
`--engine`: no HTTP; mix8's shape submitted straight to an engine in the GPU's order and step rules
(`engine_rep`: the runner overlapping, as on a GPU, where the CPU's runner does not), this tree's
and the baseline's (`--baseline REV`, or `--revert COMMIT`: HEAD without that commit) each in a
child process, interleaved; the short ones `--short_gap_ms` after the long ones. It shows the
engine's own part (`release_ms`: 1.16 -> 0.10 ms with the first token sent at its collect, 2d0a33d).

    python bench/first_token.py --baseline REV [--reps 5] [--workloads ids chat] [--steps gpu --slots 4]
    python bench/first_token.py --engine --revert COMMIT --slots 4 --short_gap_ms 5 [--reps 6] [--busy]

Writes docs/data/first_token_cpu.json and docs/first_token_cpu.md (`--page_only`: the page again
from the data) and prints the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from harness import REPO, ServerProcess, machine, on_clock, sse_events
from host_overhead import remove_worktree, worktree
from pflash_plugin.testing import cached_tiny_llama

STEPS = {"cpu": [], "gpu": ["--n_batch", "2048", "--n_ubatch", "512", "--prefill_chunk", "2048"]}
LONG_IDS = 22528  # mix8's long prompts (tokens)
WORDS = ("the river runs past old stone bridges while traders count their coins and children chase dogs "
         "through narrow lanes under a grey sky").split()


def long_body(kind: str, rng: random.Random, chars: int) -> tuple[str, dict[str, Any]]:
    if kind == "ids":
        return "/v1/completions", {"prompt": [rng.randrange(300, 1300) for _ in range(LONG_IDS)], "max_tokens": 2}
    text = " ".join(rng.choice(WORDS) for _ in range(chars // 5))[:chars]
    return "/v1/chat/completions", {"messages": [{"role": "system", "content": "Answer from the documents."},
                                                 {"role": "user", "content": text}], "max_tokens": 2}


def short_body(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    if kind == "ids":
        return "/v1/completions", {"prompt": [rng.randrange(300, 1300) for _ in range(32)], "max_tokens": 8}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Hello {rng.randrange(10**6)}"}],
                                    "max_tokens": 8}


def encoded(path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """Encoded ahead, as mix8 does: the client's JSON encoding is not counted in a TTFT."""
    full = {**body, "temperature": 0, "min_tokens": body["max_tokens"], "stream": True,
            "stream_options": {"include_usage": True}}
    return path, json.dumps(full).encode()


async def short(http: httpx.AsyncClient, url: str, request: tuple[str, bytes], after_s: float = 0.0) -> dict[str, Any]:
    path, body = request
    await asyncio.sleep(after_s)
    start = time.perf_counter()
    head = first = None
    usage: dict[str, Any] = {}
    async with http.stream("POST", url + path, content=body, headers={"content-type": "application/json"}) as reply:
        head = time.perf_counter() - start
        async for data in sse_events(reply):
            if not data.startswith("{"):
                continue
            chunk = json.loads(data)
            choice = (chunk.get("choices") or [{}])[0]
            if first is None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{url}: a stream without text")
    timings = usage.get("timings", {})
    row = {"head_ms": round(1000 * head, 2), "client_ttft_ms": round(1000 * first, 2),
           "server_ttft_ms": timings.get("ttft_ms"), "queue_ms": timings.get("queue_ms")}
    for mark in ("prepare_ms", "release_ms", "emit_ms"):  # where the server reports them (not the baseline's older trees)
        if mark in timings:
            row[mark] = timings[mark]
    clock = on_clock(usage, start)  # --usage_clock: the marks on this process's clock, ms after the sending
    if clock:
        row["in_ms"] = clock["received"]  # the client's sending, the server's accepting and reading the headers
        row["out_ms"] = round(row["client_ttft_ms"] - clock["first_written"], 2)  # the socket to the client's parse
    row["gap_ms"] = round(row["client_ttft_ms"] - row["server_ttft_ms"], 2)  # issue 48's gap: all but the engine
    marks = sum(row.get(mark, 0.0) for mark in ("prepare_ms", "release_ms", "emit_ms"))
    row["outside_ms"] = round(row["gap_ms"] - marks, 2)
    return row


async def long(http: httpx.AsyncClient, url: str, request: tuple[str, bytes]) -> None:
    path, body = request
    async with http.stream("POST", url + path, content=body, headers={"content-type": "application/json"}) as reply:
        async for _ in reply.aiter_bytes():
            pass


async def workload(url: str, kind: str, seed: str, chars: int, gap_s: float = 0.0,
                   n_long: int = 4) -> list[dict[str, Any]]:
    """The long requests, then the short ones, at once (or the short ones `gap_s` apart); the long
    ones cancelled once the short ones end."""
    rng = random.Random(seed)
    longs = [encoded(*long_body(kind, rng, chars)) for _ in range(n_long)]
    shorts = [encoded(*short_body(kind, rng)) for _ in range(4)]
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        pending = [asyncio.ensure_future(long(http, url, r)) for r in longs]
        rows = await asyncio.gather(*(short(http, url, r, i * gap_s) for i, r in enumerate(shorts)))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await idle(url)
    return rows


async def idle(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the server runs and queues nothing (the cancelled long prompts have left)."""
    deadline = time.perf_counter() + timeout_s
    async with httpx.AsyncClient(timeout=30) as http:
        while time.perf_counter() < deadline:
            models = (await http.get(url + "/status")).json()["models"]
            if all(m["running"] == 0 and m["waiting"] == 0 for m in models.values()):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}: not idle after {timeout_s} s")


def engine_rep(seed: str, slots: int, gap_ms: float, busy: bool = False) -> list[dict[str, float]]:
    """mix8's shape straight to an engine of this process's pflash_plugin (no HTTP), in the GPU's
    order and rules on the CPU: the runner overlapping (a step's text goes out beside the next
    launch; on the CPU that launch is the whole decode) and the GPU's step chunks (`--steps gpu`). 4 long prompts of token ids, then 4 short
    ones `gap_ms` later (over HTTP they reach the engine after the first long one: its step is in
    flight); `busy`: a thread beside runs Python in 2 ms bursts (as the long prompts' parse and
    preparation do over HTTP), so the engine thread waits for the GIL; per short request its engine TTFT, the wait for its admission and
    `release_ms` (its first token to its first text event leaving the engine thread)."""
    from pflash_plugin.engine import loader
    from pflash_plugin.engine.request import FinishEvent, Request, SamplingParams, TextEvent

    chunks = loader.step_chunks
    loader.step_chunks = lambda chunk, on_gpu, **kw: chunks(chunk, True, **kw)  # type: ignore[assignment]
    # the GPU's step chunks as loader.step_chunks gives them (prefill_chunk 2,048 here until session 74's defaults)
    config = loader.EngineConfig(max_ctx=LONG_IDS + 64, n_slots=slots, n_batch=2048, n_ubatch=512,
                                 n_threads=1, n_threads_batch=1)
    _, engine = loader.load_engine(cached_tiny_llama(n_ctx_train=131072), config)
    engine.runner.overlaps = True
    if busy:
        threading.Thread(target=_busy, daemon=True).start()
    rows: list[dict[str, float]] = []
    try:
        for name in ("warm-up", seed):
            rng, released, ended = random.Random(name), {}, threading.Semaphore(0)

            def sink(event: Any, i: int) -> None:  # on the engine thread
                if isinstance(event, TextEvent):
                    released.setdefault(i, time.perf_counter())
                elif isinstance(event, FinishEvent):
                    ended.release()

            prompts = [[rng.randrange(300, 1300) for _ in range(LONG_IDS if i < 4 else 32)] for i in range(8)]
            requests = []
            for i, prompt in enumerate(prompts):  # made as submitted: a request's arrival is its making
                if i == 4:
                    time.sleep(gap_ms / 1000)
                requests.append(Request(prompt, SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0),
                                        lambda event, i=i: sink(event, i)))
                engine.submit(requests[-1])
            for _ in range(4):  # the short ones' ends (the long ones are far from theirs)
                assert ended.acquire(timeout=300), "the short requests did not finish"
            for request in requests[:4]:
                engine.cancel(request)
            for _ in range(4):
                assert ended.acquire(timeout=300), "the long requests were not cancelled"
            rows = [{"server_ttft_ms": round(1000 * (t.first_token - t.arrival), 2),
                     "queue_ms": round(1000 * (t.admitted - t.arrival), 2),
                     "release_ms": round(1000 * (released[i] - t.first_token), 2)}
                    for i, t in ((i, requests[i].timings) for i in range(4, 8))]
    finally:
        engine.stop()
    return rows


def _busy() -> None:
    """Python without a pause for 2 ms at a time, for ever (the GIL's other holder)."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.002:
            sum(range(1000))
        time.sleep(0.0002)


def engine_in(tree: Path, seed: str, slots: int, gap_ms: float, extra: list[str]) -> list[dict[str, float]]:
    """`engine_rep` on `tree`'s pflash_plugin, in a child process (both arms so: alike)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, str(Path(__file__).resolve()), "--engine_child", seed, "--slots", str(slots),
            "--short_gap_ms", str(gap_ms), *extra]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_tree(args: argparse.Namespace) -> Path | None:
    """The baseline arm's tree: `--baseline REV` checked out, or `--revert COMMIT`: HEAD with that one
    commit reverted (its effect alone, whatever came after it); None without either."""
    if args.revert:
        tree = worktree("HEAD")
        subprocess.run(["git", "-C", str(tree), "revert", "--no-commit", args.revert], check=True, capture_output=True)
        return tree
    return worktree(args.baseline) if args.baseline else None


def run_engine(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--engine`: this tree's engine and the baseline's, interleaved per rep, order alternating."""
    tree = baseline_tree(args)
    trees = {"this": REPO, **({"baseline": tree} if tree is not None else {})}
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for name, root in list(trees.items())[::1 if rep % 2 == 0 else -1]:
                load = os.getloadavg()[0]
                extra = (["--busy"] if args.busy else []) + (["--gil_switch_ms", str(args.gil_switch_ms)]
                                                             if args.gil_switch_ms else [])
                for i, row in enumerate(engine_in(root, f"engine/{rep}", args.slots, args.short_gap_ms, extra)):
                    rows.append({"arm": name, "workload": "engine", "rep": rep, "short": i, "load": load, **row})
                print(json.dumps(rows[-4:]), flush=True)
    finally:
        if tree is not None:
            remove_worktree(tree)
    return rows


def run_servers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The HTTP arms (this tree's server, `--ours_arms`, the baseline's, the floor), interleaved per rep."""
    model = cached_tiny_llama(n_ctx_train=131072)
    flags = ["--model", str(model), "--max_concurrency", str(args.slots), "--n_ctx", str(args.n_ctx),
             "--verbose", "false", "--pflash", "off", "--n_threads", "1", "--n_threads_batch", "1", *STEPS[args.steps]]
    servers = {"this": ServerProcess("first-token-this", [*flags, "--usage_clock", "true"])}
    for arm in args.ours_arms:  # NAME=FLAGS: this tree's server with those flags too (commas for spaces)
        name, _, extra = arm.partition("=")
        servers[name] = ServerProcess(f"first-token-{name}", [*flags, "--usage_clock", "true", *extra.split(",")])
    tree = baseline_tree(args)
    if tree is not None:
        servers["baseline"] = ServerProcess("first-token-baseline", flags, cwd=tree)
    servers["floor"] = ServerProcess("first-token-floor", ["asgi_floor:app", "--log-level", "warning"],
                                     program=[sys.executable, "-m", "uvicorn"], cwd=REPO / "bench")
    rows: list[dict[str, Any]] = []
    try:
        for server in servers.values():
            server.start()
            asyncio.run(workload(server.url, "ids", "warm-up", args.long_chars))
        gap_s = args.short_gap_ms / 1000
        for rep in range(args.reps):
            order = list(servers.items())[::1 if rep % 2 == 0 else -1]
            for kind in args.workloads:
                for name, server in order:
                    load = os.getloadavg()[0]
                    shorts = asyncio.run(workload(server.url, kind, f"{kind}/{rep}", args.long_chars, gap_s))
                    for i, row in enumerate(shorts):
                        rows.append({"arm": name, "workload": kind, "rep": rep, "short": i, "load": load, **row})
                    print(json.dumps(rows[-4:]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
        if tree is not None:
            remove_worktree(tree)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = run_engine(args) if args.engine else run_servers(args)
    return {"rows": rows, "medians": medians(rows), "machine": machine(),
            "baseline": f"HEAD without {args.revert}" if args.revert else args.baseline,
            "long_chars": args.long_chars, "long_ids": LONG_IDS, "slots": args.slots, "steps": args.steps,
            "short_gap_ms": args.short_gap_ms,
            "command": "python bench/first_token.py " + " ".join(sys.argv[1:])}


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm and workload, the median of each mark over its short requests."""
    out = []
    for key in dict.fromkeys((r["arm"], r["workload"]) for r in rows):
        mine = [r for r in rows if (r["arm"], r["workload"]) == key]
        marks = [k for k in ("head_ms", "client_ttft_ms", "server_ttft_ms", "gap_ms", "queue_ms", "prepare_ms",
                             "release_ms", "emit_ms", "outside_ms", "in_ms", "out_ms")
                 if k in mine[0] and mine[0][k] is not None]
        out.append({"arm": key[0], "workload": key[1], "n": len(mine),
                    **{k: round(statistics.median(r[k] for r in mine), 2) for k in marks}})
    return out


MARKS = [("client_ttft_ms", "client TTFT"), ("server_ttft_ms", "engine TTFT"), ("queue_ms", "of it admission"),
         ("gap_ms", "client - engine"), ("head_ms", "headers"), ("prepare_ms", "prepare"), ("release_ms", "release"),
         ("emit_ms", "emit"), ("outside_ms", "outside"), ("in_ms", "of it in"), ("out_ms", "of it out")]


def write_page(result: dict[str, Any], path: Path) -> None:
    """The medians as a page: a row per workload and arm, the marks in ms."""
    lines = ["# A short request's first token beside long ones, on the CPU (issue 48)", "",
             "Written by `bench/first_token.py` (its docstring says what is measured); the data: "
             "[data/first_token_cpu.json](data/first_token_cpu.json). Medians over the short requests of all reps "
             f"(4 a workload and rep), in ms; `{result['baseline'] or '-'}` is the baseline arm's revision.", "",
             "| workload | arm | n | " + " | ".join(name for _, name in MARKS) + " |",
             "|---|---|---:|" + "---:|" * len(MARKS)]
    for row in result["medians"]:
        cells = [f"{row[key]:.1f}" if key in row else "-" for key, _ in MARKS]
        lines.append(f"| {row['workload']} | {row['arm']} | {row['n']} | " + " | ".join(cells) + " |")
    m = result["machine"]
    loads = [r["load"] for r in result["rows"]]
    lines += ["", f"Machine: {m['nproc']} cores, {m['cpu']}, shared with other work: 1-minute load "
              f"{min(loads):.1f}-{max(loads):.1f} during the run. The client runs on the same cores.", "",
              f"Command: `{result['command']}`", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=["ids", "chat"], choices=["ids", "chat"])
    parser.add_argument("--long_chars", type=int, default=200_000, help="chat: each long prompt's characters")
    parser.add_argument("--n_ctx", type=int, default=131072, help="each slot's context (a long chat prompt fits)")
    parser.add_argument("--baseline", help="a git revision whose server runs beside this tree's")
    parser.add_argument("--revert", help="the baseline: HEAD with this one commit reverted (instead of --baseline)")
    parser.add_argument("--ours_arms", nargs="*", default=[], metavar="NAME=FLAGS",
                        help="this tree's server with more flags, as an arm of its own: gil=--gil_switch_ms,0.5")
    parser.add_argument("--short_gap_ms", type=float, default=0.0,
                        help="the short requests sent this far apart (0: at once, as mix8); --engine: this long "
                        "after the long ones")
    parser.add_argument("--slots", type=int, default=8, help="the servers' --max_concurrency (mix8: 4)")
    parser.add_argument("--steps", choices=sorted(STEPS), default="cpu",
                        help="the servers' step shape: the CPU's defaults, or the H200's (n_batch 2048, no cap)")
    parser.add_argument("--engine", action="store_true",
                        help="mix8's shape straight to the engine in the GPU's order (engine_rep), instead of HTTP")
    parser.add_argument("--engine_child", help=argparse.SUPPRESS)  # engine_in's child: one rep of this seed
    parser.add_argument("--busy", action="store_true", help="--engine: a thread beside runs Python (the GIL)")
    parser.add_argument("--gil_switch_ms", type=float, help="--engine: Python's thread switch interval (ms)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "data" / "first_token_cpu.json")
    parser.add_argument("--page", type=Path, default=REPO / "docs" / "first_token_cpu.md")
    parser.add_argument("--page_only", action="store_true", help="write the page from --out's data, run nothing")
    args = parser.parse_args()
    if args.engine_child:
        if args.gil_switch_ms:
            sys.setswitchinterval(args.gil_switch_ms / 1000)
        print(json.dumps(engine_rep(args.engine_child, args.slots, args.short_gap_ms, args.busy)))
        return
    if args.page_only:
        write_page(json.loads(args.out.read_text()), args.page)
        return
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    write_page(result, args.page)
    for row in result["medians"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()

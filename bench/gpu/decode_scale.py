"""Decode at scale on a real vocabulary: ours (backend sampling on and off) against llama-server
(with and without `-bs`) and llama-cpp-python's own example server (`--servers ... upstream`, in its
best configuration: bench/upstream.py), per sampling mode, and the host's time per step of our engine.

On the CUDA machine, with the 128K-vocabulary models (`VOCAB_EXTRA=127000`, bench/gpu/setup.sh):
    VOCAB_EXTRA=127000 bash bench/gpu/servers.sh bench/gpu/decode_scale.py --out $OUT/decode_scale.json
On a CPU, tiny shapes (a check of the script): `--target TINY.gguf --drafter x --llama-server none
--gpu-layers 0 --clients 4 --tokens 16 --reps 1`.
Speculation (issue 47): `--arms servers --servers ours-host-sampling ours-lookup --clients 1 64 128`:
prompt lookup against the same server without it (the adaptive policy should leave 64 and 128
clients as fast as without; /status's speculation counts what it drafted).

Throughput: C clients each send 2 requests of `--tokens` tokens one after the other to
/v1/completions (random token-id prompts of 32 tokens; every token generated: ours `min_tokens`,
llama-server `ignore_eos`), completion tokens from `usage` over the wall time; all servers loaded,
one driven at a time, reps interleaved (mode by mode, server by server); medians over reps.
Modes: greedy; temperature 0.8 + top_p 0.9; the same with a seed per request; with presence and
frequency penalties; greedy with one client's requests held to a JSON grammar; greedy and seeded
streamed (`*_streamed`: tokens from the last chunk's usage, or all of them where a server sends none).
Engine arm (`--arms engine`): our engine in this process, 64 requests at once, host sampling, with the
host's work between steps overlapping the next decode (the GPU default) and without: ms per step;
without the overlap each llama_decode is also timed with its synchronization (the decode, and the
host's rest; timing it so would end the overlap). Each step is also split by part (the llama_decode
call, the wait for the device, the host's parts) with llama.cpp's graph reuses per step;
`--engine-sampling off on` adds greedy rows sampled on the device; `--engine-contexts 2` splits the
slots over two contexts of the model, each stepped by its own engine thread (issue 48 item 5).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu import (  # noqa: E402
    Record, Server, client, complete, log_dir, models_parser, run_arms, stream_times, token_ids)
from upstream import UpstreamServer, model_options  # noqa: E402  (bench/, on the path through multi_gpu)

JSON_GRAMMAR = r'''root ::= "{" ws "\"a\":" ws [0-9]+ ws "}" ws
ws ::= [ \n]*'''
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": "per request"},
    "penalties": {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "json_row": {"temperature": 0},  # client 0 sends JSON_GRAMMAR
    "greedy_streamed": {"temperature": 0, "stream": True},
    "seeded_streamed": {"temperature": 0.8, "top_p": 0.9, "seed": "per request", "stream": True},
}


def ours(label: str, port: int, args: argparse.Namespace, backend: str, *extra: str) -> Server:
    return Server(label, [
        "--model", args.target, "--n_gpu_layers", str(args.gpu_layers), "--n_ctx", "512",
        "--max_concurrency", str(args.slots), "--max_queue", "1024", "--flash_attn", "true",
        "--backend_sampling", backend, "--verbose", "false", *extra,
    ], port=port, log_dir=log_dir(args), ours=True)


def llama_server(label: str, port: int, args: argparse.Namespace, *extra: str) -> Server:
    return Server(label, [
        "-m", args.target, "--host", "127.0.0.1", "-ngl", "999", "-c", str(512 * args.slots), "-np", str(args.slots),
        "-fa", "on", "--cache-ram", "0", *extra,
    ], program=[args.llama_server], port=port, log_dir=log_dir(args))


def upstream(label: str, port: int, args: argparse.Namespace) -> UpstreamServer:
    """llama-cpp-python's own batched server (bench/upstream.py), as many slots and cells as the others."""
    options = model_options(args.target, slots=args.slots, n_ctx=512 * args.slots, gpu=args.gpu_layers != 0)
    return UpstreamServer(label, [], port=port, log_dir=log_dir(args), options=options)


def request_body(server: Server, mode: str, rng: random.Random, args: argparse.Namespace, grammar: bool) -> dict:
    body: dict[str, Any] = {"prompt": token_ids(32, rng), "max_tokens": args.tokens, "repeat_penalty": 1.0,
                            "top_k": 40, "min_p": 0.0, "top_p": 1.0, **MODES[mode]}
    if body.get("seed") == "per request":
        body["seed"] = rng.randrange(2**31)
    if grammar:
        body["grammar"] = JSON_GRAMMAR
    if server.ours:
        body["min_tokens"] = 0 if grammar else args.tokens
    else:
        body.update(ignore_eos=not grammar, cache_prompt=False)
    return body


async def throughput(server: Server, mode: str, clients: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)

    async def one_client(http: httpx.AsyncClient, index: int) -> int:
        tokens = 0
        for _ in range(2):
            body = request_body(server, mode, rng, args, mode == "json_row" and index == 0)
            if body.pop("stream", False):  # the usage of the last chunk (ours), or every token (ignore_eos)
                _, usage = await stream_times(http, server, {**body, "stream_options": {"include_usage": True}})
                tokens += usage["completion_tokens"] if usage else args.tokens
            else:
                tokens += (await complete(http, server, body))["usage"]["completion_tokens"]
        return tokens

    async with client() as http:
        start = time.perf_counter()
        counts = await asyncio.wait_for(asyncio.gather(*(one_client(http, i) for i in range(clients))), args.limit_s)
        wall = time.perf_counter() - start
    return {"clients": clients, "tokens": sum(counts), "wall_s": round(wall, 3), "tok_s": round(sum(counts) / wall, 1)}


@contextlib.contextmanager
def sample_threads(count: int | None) -> Iterator[None]:
    """Sampling's host pass on `count` threads (None: the engine's own, Context.host_threads) while inside."""
    from pflash_plugin.llama.context import Context

    own = Context.host_threads
    if count:
        Context.host_threads = property(lambda _: count)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        Context.host_threads = own  # type: ignore[method-assign]


def engine_steps(args: argparse.Namespace, mode: str, backend: str, overlap: bool, tracer: Any = None,
                 threads: int | None = None) -> dict[str, Any]:
    """Our engine in this process: tok/s, and per step the wall time; without `overlap` also the
    decode's (llama_decode and its synchronization) and the host's rest. Per step also its parts
    (`parts_ms`, host_overhead.PhaseTimer: "decode" the llama_decode call alone, which on a GPU
    returns once the step is launched; "wait" the collect blocked on the device's outputs; the rest
    host work), `serial_host_ms` (the step less the wait and less what runs beside the device where it
    overlaps: text, emit, stats; the host time the device idles through) and llama.cpp's graph reuses
    per step (1.0: every step's ubatch ran on the graph built before, so CUDA graphs replay it).
    With `tracer` (cupti.Tracer) the run is traced: per step the GPU's busy time, its kernels, copies
    and the host's CUDA calls. `threads`: sampling's host pass on so many threads (None: the engine's)."""
    from pflash_plugin.engine.loader import EngineConfig, load_engine
    from harness import run_to_end
    from host_overhead import PhaseTimer
    from step_log import StepLog
    from pflash_plugin.llama import ModelParams

    config = EngineConfig(n_slots=args.slots, max_ctx=512, flash_attn=True, backend_sampling=backend,
                          model=ModelParams(n_gpu_layers=args.gpu_layers))
    model, engine = load_engine(args.target, config)
    engine.runner.overlaps = overlap
    ctx, decode_s = engine.runner.ctx, [0.0]
    decode = ctx.decode

    def timed(batch) -> None:
        start = time.perf_counter()
        decode(batch)
        ctx.synchronize()
        decode_s[0] += time.perf_counter() - start

    if not overlap:
        ctx.decode = timed  # type: ignore[method-assign]
    timer = PhaseTimer(engine)
    log = StepLog(engine, timer, args.slots)
    try:
        requests = engine_requests(args, mode)
        steps, reused = engine.steps, ctx.graph_reuses()
        if tracer is None:
            with sample_threads(threads):
                wall, trace = run_to_end(engine, requests, args.limit_s), None
                threads = ctx.host_threads
        else:
            wall, trace = tracer.record(lambda: run_to_end(engine, requests, args.limit_s),
                                        lambda _: engine.steps - steps, Path(f"/tmp/trace-{mode}-{overlap}.txt"))
        steps, reused = engine.steps - steps, ctx.graph_reuses() - reused
    finally:
        engine.stop()
        engine.close()
        model.close()
    tokens = sum(len(r.output_tokens) for r in requests)
    outputs = hash(tuple(tuple(r.output_tokens) for r in requests))  # greedy: the same with the device on and off
    row = {"mode": mode, "backend_sampling": backend, "overlap": overlap, "outputs": outputs, "sample_threads": threads,
           "tok_s": round(tokens / wall, 1), "steps": steps, "step_ms": round(1000 * wall / steps, 3)}
    parts = timer.per_step(steps, wall)
    beside = sum(parts.get(part, 0.0) for part in ("text", "emit", "stats")) if overlap else 0.0
    row.update(parts_ms={part: round(ms, 3) for part, ms in parts.items()}, graph_reuses_per_step=round(reused / steps, 3),
               kv_unified=ctx.config.kv_unified,
               serial_host_ms=round(1000 * wall / steps - parts.get("wait", 0.0) - beside, 3))
    row.update(log.summary())  # the steady decode steps' medians apart from prefill and rebuilt graphs
    if not overlap:
        row.update(decode_ms=round(1000 * decode_s[0] / steps, 3), host_ms=round(1000 * (wall - decode_s[0]) / steps, 3))
    if trace is not None:
        row.update(slots=args.slots, trace=trace)
    return row


def engine_requests(args: argparse.Namespace, mode: str) -> list[Any]:
    """The engine arm's requests: one per slot, a random 32-token prompt, every token generated."""
    from pflash_plugin.engine.request import Request, SamplingParams

    rng = random.Random(5)
    fields = {"top_k": 40, "min_p": 0.0, "top_p": 1.0, **MODES[mode]}
    return [Request(token_ids(32, rng), SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens,
                                                       **{**fields, "seed": i if "seed" in fields else None}))
            for i in range(args.slots)]


def engine_contexts(args: argparse.Namespace, mode: str, contexts: int) -> dict[str, Any]:
    """The slots split over `contexts` engines on one loaded model (each its own llama.cpp context, KV,
    graph, CUDA stream and engine thread), the requests dealt out among them and submitted at once:
    whether one context's host work between its decodes runs beside another's kernels. Host sampling,
    the overlap on; tok/s over all, and per context its steps, ms per step and graph reuses per step."""
    from pflash_plugin.engine.loader import EngineConfig, build_engine, load_model
    from pflash_plugin.engine.request import ErrorEvent, FinishEvent
    from pflash_plugin.llama import ModelParams

    config = EngineConfig(n_slots=args.slots // contexts, max_ctx=512, flash_attn=True, backend_sampling="off",
                          model=ModelParams(n_gpu_layers=args.gpu_layers))
    model = load_model(args.target, config)
    engines = [build_engine(model, config, name=f"engine-{i}") for i in range(contexts)]
    requests = engine_requests(args, mode)[: config.n_slots * contexts]
    done = threading.Semaphore(0)
    for request in requests:
        request.sink = lambda event: done.release() if isinstance(event, (FinishEvent, ErrorEvent)) else None
    try:
        steps, reused = [e.steps for e in engines], [e.runner.ctx.graph_reuses() for e in engines]
        start = time.perf_counter()
        for i, engine in enumerate(engines):
            engine.submit(*requests[i::contexts])
        for _ in requests:
            assert done.acquire(timeout=args.limit_s), "the engines did not finish"
        wall = time.perf_counter() - start
        steps = [e.steps - n for e, n in zip(engines, steps)]
        reused = [e.runner.ctx.graph_reuses() - n for e, n in zip(engines, reused)]
    finally:
        for engine in engines:
            engine.stop()
            engine.close()
        model.close()
    tokens = sum(len(r.output_tokens) for r in requests)
    return {"mode": mode, "backend_sampling": "off", "overlap": True, "contexts": contexts, "tok_s": round(tokens / wall, 1),
            "outputs": hash(tuple(tuple(r.output_tokens) for r in requests)), "steps_per_context": steps,
            "step_ms_per_context": [round(1000 * wall / n, 3) for n in steps],
            "graph_reuses_per_step": round(sum(reused) / sum(steps), 3)}


SERVERS = ("ours", "ours-host-sampling", "llama-server", "llama-server-bs", "upstream", "ours-lookup", "ours-gil",
           "ours-graphs-off")


def side_by_side(args: argparse.Namespace, record: Record) -> None:
    """Every server up at once, the rows interleaved server by server; with --one-at-a-time each
    server alone on the device for its rows of a rep, in turn (two processes with CUDA graphs on one
    host hung under load: docs/multi_gpu.md, bench/gpu/hang_diag.py)."""
    servers = [ours("ours", args.port, args, "on"), ours("ours-host-sampling", args.port + 1, args, "off")]
    if args.llama_server != "none":
        servers += [llama_server("llama-server", args.port + 2, args),
                    llama_server("llama-server-bs", args.port + 3, args, "-bs")]
    servers += [upstream("upstream", args.port + 4, args),
                ours("ours-lookup", args.port + 5, args, "off", "--draft_model", "prompt-lookup-decoding"),
                ours("ours-gil", args.port + 6, args, "off", "--gil_switch_ms", "0.5"),
                ours("ours-graphs-off", args.port + 7, args, "off", "--cuda_graphs", "off")]
    servers = [server for server in servers if server.label in args.servers]
    cells = [(mode, clients) for mode in args.modes for clients in args.clients]
    if args.one_at_a_time:
        for rep in range(args.reps):
            for server in servers:
                with running([server], record, args):
                    for mode, clients in cells:
                        record.add(measured(server, mode, clients, rep, args))
        return
    with running(servers, record, args):
        for rep in range(args.reps):
            for mode, clients in cells:
                for server in servers:
                    record.add(measured(server, mode, clients, rep, args))


@contextlib.contextmanager
def running(servers: list[Server], record: Record, args: argparse.Namespace) -> Iterator[None]:
    """The servers launched together, each warmed up once ready (a `start` row each), stopped after."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            ready = server.wait_ready(600)
            asyncio.run(throughput(server, "greedy", 4, args, seed=1))  # warm-up
            record.add({"server": server.label, "kind": "start", "ready_s": round(ready, 1)})
        yield
    finally:
        for server in servers:
            server.stop()


def measured(server: Server, mode: str, clients: int, rep: int, args: argparse.Namespace) -> dict[str, Any]:
    """One throughput row; a failure costs this row only, and a hung server is started afresh."""
    row: dict[str, Any] = {"server": server.label, "kind": "throughput", "mode": mode, "rep": rep}
    try:
        before = speculation(server)
        row.update(asyncio.run(throughput(server, mode, clients, args, seed=100 * rep + clients)))
        after = speculation(server)
        if after:  # what a speculating server drafted and kept in this run (issue 47)
            row["speculation"] = {k: round(after.get(k, 0) - before.get(k, 0), 4) for k in SPEC_COUNTS}
    except Exception as error:
        row.update(clients=clients, error=f"{type(error).__name__}: {error}"[:1000])
        if server.proc is not None and server.proc.poll() is not None:  # a ReadError: did it die?
            row["exit_code"] = server.proc.returncode
        if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
            row["restart"] = restart(server, args)  # hung: its later rows would only time out
    return row


def restart(server: Server, args: argparse.Namespace) -> str:
    """A hung server started afresh and warmed up (its log so far kept beside), or why not."""
    try:
        ready = server.restart(600)
        asyncio.run(throughput(server, "greedy", 4, args, seed=1))
        return f"ready after {ready:.1f} s"
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:300]


# /status speculation counters a run's row shows: drafts, and where the steps' time went (steps with
# drafts, the plain steps right after them, other plain steps; probes; unpaid: speculation/budget.py)
SPEC_COUNTS = ("drafted", "accepted", "probes", "draft_steps", "draft_step_seconds", "settle_steps",
               "settle_step_seconds", "plain_steps", "plain_step_seconds", "excess_seconds", "unpaid_seconds")


def speculation(server: Server) -> dict[str, int]:
    """Ours' speculation counts since start (/status; empty for a server that does not speculate)."""
    if not server.ours:
        return {}
    models = httpx.get(server.url + "/status", timeout=10).json().get("models", {})
    return next(iter(models.values()), {}).get("speculation") or {}


def table(data: dict[str, Any]) -> str:
    """Markdown: tok/s medians per mode and clients (a column per server), then the engine's steps."""
    rows = [r for r in data["results"].get("servers", []) if r.get("kind") == "throughput"]
    servers = list(dict.fromkeys(r["server"] for r in rows))
    lines = ["| mode | clients | " + " | ".join(servers) + " |", "|---|---|" + "---|" * len(servers)]
    for mode, clients in dict.fromkeys((r["mode"], r["clients"]) for r in rows):
        cells = [[r["tok_s"] for r in rows if "tok_s" in r and (r["mode"], r["clients"], r["server"])
                  == (mode, clients, s)] for s in servers]  # a failed row (timed out) has no rate
        lines.append(f"| {mode} | {clients} | " + " | ".join(f"{statistics.median(c):,.0f}" if c else "failed"
                                                             for c in cells) + " |")
    steps = [r for r in data["results"].get("engine", []) if "step_ms" in r and "trace" not in r]
    if steps:
        lines += ["", "| engine: mode | backend sampling | overlap | sample threads | tok/s | ms/step | decode ms | host ms "
                  "| serial host ms | graph reuses/step |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['backend_sampling']} | {r.get('overlap', False)} | {r.get('sample_threads', '-')} | "
                  f"{r['tok_s']:,.0f} | {r['step_ms']} | {r.get('decode_ms', '-')} | {r.get('host_ms', '-')} | "
                  f"{r.get('serial_host_ms', '-')} | {r.get('graph_reuses_per_step', '-')} |" for r in steps]
        parted = [r for r in steps if r.get("parts_ms")]
        if parted:
            names = list(dict.fromkeys(p for r in parted for p in r["parts_ms"]))
            lines += ["", "| engine: mode | backend sampling | overlap | sample threads | " + " | ".join(f"{p} ms" for p in names)
                      + " |", "|---|---|---|---|" + "---|" * len(names)]
            lines += [f"| {r['mode']} | {r['backend_sampling']} | {r.get('overlap', False)} | {r.get('sample_threads', '-')} | "
                      + " | ".join(str(r["parts_ms"].get(p, "-")) for p in names) + " |" for r in parted]
        lines += steady_table([r for r in steps if r.get("steady_steps")])
    split = [r for r in data["results"].get("engine", []) if "contexts" in r]
    if split:
        lines += ["", "| engine: mode | contexts | tok/s | ms/step per context | graph reuses/step |", "|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['contexts']} | {r['tok_s']:,.0f} | {r['step_ms_per_context']} | "
                  f"{r['graph_reuses_per_step']} |" for r in split]
    greedy = {r["outputs"] for r in steps + split if r["mode"] == "greedy"}
    if greedy:
        lines += ["", f"greedy tokens the same in every engine arm: {len(greedy) == 1}"]
    return "\n".join(lines)


def steady_table(rows: list[dict[str, Any]]) -> list[str]:
    """The engine rows' steady decode steps (StepLog): medians per step, apart from prefill and rebuilt graphs."""
    if not rows:
        return []
    names = list(dict.fromkeys(p for r in rows for p in r["steady_parts_ms"]))
    return ["", "| engine, steady steps: mode | backend sampling | overlap | steady steps | other steps' share of time "
            "| ms/step | mean ms/step | " + " | ".join(f"{p} ms" for p in names) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(names)] + [
        f"| {r['mode']} | {r['backend_sampling']} | {r.get('overlap', False)} | {r['steady_steps']} | "
        f"{r['other_steps_share']} | {r['steady_step_ms']} | {r.get('steady_step_mean_ms', '-')} | " + " | ".join(str(r["steady_parts_ms"].get(p, "-"))
                                                                         for p in names) + " |" for r in rows]


def main() -> None:
    parser = models_parser(__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["engine", "servers"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--clients", nargs="+", type=int, default=[64])
    parser.add_argument("--servers", nargs="+", default=list(SERVERS[:4]), choices=SERVERS,
                        help="ours: --backend_sampling on; ours-host-sampling: off (what auto picks with the native "
                        "sampler); upstream: llama-cpp-python's example server (bench/upstream.py); ours-lookup: "
                        "host sampling with prompt lookup speculation (--draft_model prompt-lookup-decoding, issue 47); ours-gil: "
                        "host sampling with --gil_switch_ms 0.5")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu-layers", dest="gpu_layers", type=int, default=-1)
    parser.add_argument("--limit-s", dest="limit_s", type=float, default=180.0)
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--one-at-a-time", dest="one_at_a_time", action="store_true",
                        help="servers arm: each server alone on the device for its rows of a rep, in turn")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine-sampling", dest="engine_sampling", nargs="+", default=["off"],
                        choices=["off", "on", "auto"], help="the engine arm's --backend_sampling settings (each "
                        "interleaved with the others in a rep; on: greedy rows too are sampled on the device)")
    parser.add_argument("--engine-sample-threads", dest="engine_sample_threads", nargs="*", type=int, default=[],
                        help="the engine arm also runs with sampling's host pass (the greedy rows' argmax) on so "
                        "many threads, each count once a rep (overlap on, host sampling)")
    parser.add_argument("--engine-contexts", dest="engine_contexts", nargs="*", type=int, default=[],
                        help="the engine arm also splits the slots over so many contexts of one model, each "
                        "stepped by its own engine thread (e.g. 2: two contexts of 32 slots), in every rep")
    parser.add_argument("--trace", help="cupti_trace.so (built as in draft_profile.sh): after the engine arm's reps, "
                        "one more run per mode and overlap, traced")
    args = parser.parse_args()

    def run(arm: str, record: Record) -> None:
        if arm == "engine":
            for rep in range(args.reps):
                for mode in args.modes:
                    for overlap in (True, False)[::1 if rep % 2 == 0 else -1]:  # each first in turn
                        for backend in args.engine_sampling:
                            record.add({**engine_steps(args, mode, backend, overlap), "rep": rep})
                    for threads in args.engine_sample_threads:
                        record.add({**engine_steps(args, mode, "off", True, threads=threads), "rep": rep})
                    for contexts in args.engine_contexts:
                        record.add({**engine_contexts(args, mode, contexts), "rep": rep})
            if args.trace:
                from cupti import Tracer
                tracer = Tracer(args.trace)
                for mode in args.modes:
                    for overlap in (True, False):
                        record.add({**engine_steps(args, mode, "off", overlap, tracer), "rep": "traced"})
        else:
            side_by_side(args, record)

    run_arms(args.out, args.arms, run)
    print(table(json.loads(args.out.read_text())))


if __name__ == "__main__":
    main()

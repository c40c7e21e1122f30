"""Two GPUs: ours against llama.cpp's llama-server with the same split, and two replicas of ours.

On the CUDA machine (bench/gpu/multi_gpu.sh builds both servers, writes the models and runs this):
    python bench/gpu/multi_gpu.py --target T.gguf --drafter D.gguf --llama-server BIN --out r.json

Per split mode (`none`, `layer`, `row`), ours and llama-server (with its defaults, and with
`--cache-ram 0`) run side by side (all loaded, one driven at a time, reps interleaved ours,
llama-server, ..., ours, ...) and are measured over HTTP on
/v1/completions with random token-id prompts (the models are random-weight GGUFs, tiled):
- throughput: C clients each send 2 requests of 128 tokens one after the other, C = 16 and 64;
  completion tokens from `usage` over the wall time of the whole run;
- TTFT of 4 short streamed requests sent together, idle and 0.5 s after a 32K-token prompt
  (`--beside`) was sent (ours prefills it in full: per-request `pflash: {"mode": "off"}`);
- time to the first token of a 64K-token prompt (`--long`): llama-server's full prefill, ours in
  full and with PFlash (the drafter on main_gpu).
Both servers get 64 slots and a KV pool of twice `--long` cells (llama-server's unified KV).
Arm `replicas`: ours twice, one per GPU (CUDA_VISIBLE_DEVICES=i; `replicas-main-gpu`: every GPU
visible and `--split_mode 0 --main_gpu i`), with llama.cpp's CUDA graphs off
(GGML_CUDA_DISABLE_GRAPHS=1; `replicas-cuda-graphs` leaves them on, and hung on two H200s); 64
clients on one replica alone, then 64 on each at once, interleaved.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for harness
from harness import ServerProcess, sse_events  # noqa: E402

VOCAB = (300, 1300)  # plain tokens of write_tiny_llama's vocabulary (about 1,341 tokens)
SLOTS = 64
MAX_TOKENS = 128
SPLITS = {"none": 0, "layer": 1, "row": 2}


@dataclass(frozen=True)
class Replicas:
    """How each replica gets its GPU: `--main_gpu i` with every GPU visible, or only GPU i visible
    (CUDA_VISIBLE_DEVICES); whether llama.cpp may use CUDA graphs; and extra flags."""

    visible_devices: bool
    cuda_graphs: bool = False
    extra: tuple[str, ...] = ()

    def env(self, gpu: int) -> dict[str, str]:
        env = {"CUDA_VISIBLE_DEVICES": str(gpu)} if self.visible_devices else {}
        return env if self.cuda_graphs else {**env, "GGML_CUDA_DISABLE_GRAPHS": "1"}


REPLICAS = {
    "replicas": Replicas(visible_devices=True),
    # with CUDA graphs on, two replicas hung on two H200s in 5 of 5 runs, each GPU visible or not
    # (docs/multi_gpu.md); this arm reproduces that
    "replicas-cuda-graphs": Replicas(visible_devices=True, cuda_graphs=True),
    "replicas-main-gpu": Replicas(visible_devices=False),
    "replicas-few-threads": Replicas(visible_devices=False, extra=("--n_threads", "4", "--n_threads_batch", "8")),
}


@dataclass
class Server(ServerProcess):
    """Ours (`python -m pflash_plugin.server`) or llama-server, ready once /health answers."""

    ours: bool = False
    ready_paths: tuple[str, ...] = ("/health",)


def log_dir(args: argparse.Namespace) -> Path:
    return args.out.parent / "logs"


def ours(label: str, port: int, args: argparse.Namespace, split: str, main_gpu: int = 0) -> Server:
    return Server(label, [
        "--model", args.target,
        "--n_gpu_layers", "-1", "--split_mode", str(SPLITS[split]), "--main_gpu", str(main_gpu),
        "--n_ctx", str(args.long + 4096), "--kv_pool_tokens", str(2 * args.long), "--max_concurrency", str(SLOTS),
        "--max_queue", "256", "--n_batch", "2048", "--n_ubatch", "512", "--flash_attn", "true",
        "--pflash", "auto", "--pflash_drafter", args.drafter, "--pflash_keep_ratio", "0.1",
        "--pflash_threshold", str(args.beside // 2),
    ], port=port, log_dir=log_dir(args), ours=True)


def llama_server(label: str, port: int, args: argparse.Namespace, split: str, *extra: str) -> Server:
    """llama-server as ours is run: same slots, pool, batch sizes and split. `--cache-ram 0` turns off
    its prompt cache in RAM (8 GiB by default), which saves a slot's state whenever a new request
    takes the slot (about 0.11 s each on an H200 here)."""
    return Server(label, [
        "-m", args.target, "--host", "127.0.0.1",
        "-ngl", "999", "-sm", split, "-c", str(2 * args.long), "-np", str(SLOTS), "-kvu",
        "-b", "2048", "-ub", "512", "-fa", "on", *extra,
    ], program=[args.llama_server], port=port, log_dir=log_dir(args))


def token_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def body(server: Server, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A /v1/completions body, plain greedy on both servers (no repeat penalty: llama_cpp.server's
    default is 1.1, llama-server's 1.0) and every token generated (ours: `min_tokens`; llama-server:
    `ignore_eos`, and no reuse of its cache); ours takes per-request PFlash control (`pflash`)."""
    pflash = extra.pop("pflash", None)
    request: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "repeat_penalty": 1.0,
                               **extra}
    if server.ours:
        request["min_tokens"] = max_tokens
        if pflash:
            request["pflash"] = {"mode": pflash}
    else:
        request.update(ignore_eos=True, cache_prompt=False)
    return request


async def complete(client: httpx.AsyncClient, server: Server, request: dict[str, Any]) -> dict[str, Any]:
    reply = await client.post(server.url + "/v1/completions", json=request)
    if reply.status_code != 200:
        raise RuntimeError(f"{server.label}: {reply.status_code} {reply.text[:300]}")
    return reply.json()


def streamed(request: dict[str, Any]) -> bytes:
    """A request's body, streamed, encoded ahead: a client sending several large bodies at once
    would otherwise count their encoding in the TTFT of those it sends after them."""
    return json.dumps({**request, "stream": True}).encode()


async def first_token_s(client: httpx.AsyncClient, server: Server, request: dict[str, Any] | bytes) -> float:
    """Seconds from sending a streamed request (a body, or one of `streamed`) to its first chunk with
    text (the stream is then read to its end)."""
    return (await stream_times(client, server, request))[0]


async def stream_times(client: httpx.AsyncClient, server: Server,
                       request: dict[str, Any] | bytes) -> tuple[float, dict[str, Any] | None]:
    """`first_token_s`, and the `usage` of the stream's last chunk that has one (ours sends it with
    `stream_options: {"include_usage": true}`: the server's own timings, `ttft_ms` among them)."""
    body = request if isinstance(request, bytes) else streamed(request)
    start, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", server.url + "/v1/completions", content=body,
                             headers={"content-type": "application/json"}) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{server.label}: {reply.status_code} {(await reply.aread())[:300]!r}")
        async for data in sse_events(reply):
            if not data.startswith("{"):
                continue
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            if first is None and choices and choices[0].get("text"):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{server.label}: a stream without text")
    return first, usage


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))


def stack_dump(servers: list[Server]) -> None:
    """Every thread's Python stack into each of our servers' logs (faulthandler on SIGUSR1)."""
    for server in servers:
        if server.ours and server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGUSR1)
    time.sleep(3)


async def throughput(servers: list[Server], clients: int, seed: int, limit_s: float = 120.0) -> dict[str, Any]:
    """`clients` clients on each server at once, each sending 2 requests one after the other; a
    run that outlasts `limit_s` has each server write its threads' stacks to its log, and fails.
    With several servers, each one's tokens/s over its own clients' time is kept too."""
    rng = random.Random(seed)

    async def one_client(http: httpx.AsyncClient, server: Server) -> tuple[str, int, float]:
        tokens = 0
        for _ in range(2):
            reply = await complete(http, server, body(server, token_ids(32, rng), MAX_TOKENS))
            tokens += reply["usage"]["completion_tokens"]
        return server.label, tokens, time.perf_counter()

    async with client() as http:
        start = time.perf_counter()
        try:
            done = await asyncio.wait_for(
                asyncio.gather(*(one_client(http, s) for s in servers for _ in range(clients))), limit_s)
        except asyncio.TimeoutError:
            stack_dump(servers)
            raise RuntimeError(f"{clients} clients on {len(servers)} servers not done in {limit_s:.0f} s") from None
        wall = time.perf_counter() - start
    counts = [tokens for _, tokens, _ in done]
    result = {"clients": clients, "servers": len(servers), "tokens": sum(counts), "wall_s": round(wall, 3),
              "tok_s": round(sum(counts) / wall, 1), "short_requests": sum(c < 2 * MAX_TOKENS for c in counts)}
    if len(servers) > 1:
        result["per_server"] = {
            s.label: round(sum(t for label, t, _ in done if label == s.label)
                           / (max(end for label, _, end in done if label == s.label) - start), 1)
            for s in servers}
    return result


async def ttft_beside_prefill(server: Server, seed: int, long_tokens: int, probes: int = 4) -> dict[str, Any]:
    """Median TTFT of `probes` short streamed requests, idle and while a long prompt prefills."""
    rng = random.Random(seed)

    def probe() -> dict[str, Any]:
        return body(server, token_ids(32, rng), 8)

    async with client() as http:
        idle = await asyncio.gather(*(first_token_s(http, server, probe()) for _ in range(probes)))
        long = asyncio.create_task(first_token_s(http, server, body(server, token_ids(long_tokens, rng), 1, pflash="off")))
        await asyncio.sleep(0.5)
        beside = await asyncio.gather(*(first_token_s(http, server, probe()) for _ in range(probes)))
        long_s = await long
    return {"idle_s": round(statistics.median(idle), 4), "beside_s": round(statistics.median(beside), 4),
            "long_ttft_s": round(long_s, 3), "probes_before_long": sum(b < long_s - 0.5 for b in beside)}


async def long_prompt(server: Server, seed: int, tokens: int) -> dict[str, Any]:
    """Time to the first token of one long prompt: full prefill, and with PFlash on ours."""
    rng = random.Random(seed)
    result = {}
    async with client() as http:
        for mode in ("off", "always") if server.ours else ("off",):
            start = time.perf_counter()
            reply = await complete(http, server, body(server, token_ids(tokens, rng), 1, pflash=mode))
            result[f"{'full' if mode == 'off' else 'pflash'}_s"] = round(time.perf_counter() - start, 3)
            if mode == "always":
                result["pflash_report"] = reply["usage"]["timings"]["pflash"]
                result["timings"] = {k: v for k, v in reply["usage"]["timings"].items() if k != "pflash"}
    return result


def status(server: Server) -> dict[str, Any]:
    if not server.ours:
        return {}
    model = next(iter(httpx.get(server.url + "/status", timeout=10).json()["models"].values()))
    keys = ("pflash_threshold", "pflash_calibration", "pflash_scorer", "kv_pages_total", "kv_page_size")
    return {k: model.get(k) for k in keys}


def warm(server: Server) -> None:
    asyncio.run(throughput([server], 4, seed=1))


@dataclass
class Record:
    """The run's results, written out after every row so that a run cut short keeps what it measured."""

    path: Path
    data: dict[str, Any]
    arm: str = ""

    def add(self, row: dict[str, Any]) -> None:
        self.data["results"].setdefault(self.arm, []).append(row)
        print(json.dumps(row), flush=True)
        self.path.write_text(json.dumps(self.data, indent=1))


def start_all(servers: list[Server], record: Record, ready_s: float = 400.0) -> None:
    for server in servers:
        server.launch()
    for server in servers:
        ready = server.wait_ready(ready_s)
        warm(server)
        record.add({"server": server.label, "kind": "start", "ready_s": round(ready, 1), **status(server)})


def side_by_side(servers: list[Server], args: argparse.Namespace, record: Record) -> None:
    """The servers up at once, driven one at a time, reps interleaved."""
    try:
        start_all(servers, record)
        for rep in range(args.reps):
            for server in servers:
                for clients in (16, 64):
                    record.add({"server": server.label, "kind": "throughput", "rep": rep,
                                **asyncio.run(throughput([server], clients, seed=100 * rep + clients))})
                record.add({"server": server.label, "kind": "ttft", "rep": rep,
                            **asyncio.run(ttft_beside_prefill(server, 7 + rep, args.beside))})
                record.add({"server": server.label, "kind": "long", "rep": rep,
                            **asyncio.run(long_prompt(server, 11 + rep, args.long))})
    finally:
        for server in servers:
            server.stop()


def replicas(args: argparse.Namespace, record: Record, how: Replicas) -> None:
    """Ours once per GPU; 64 clients on replica 0 alone, then 64 on each at once, interleaved."""
    pair = []
    for i in range(2):
        server = ours(f"ours-gpu{i}", args.port + i, args, "none", main_gpu=0 if how.visible_devices else i)
        server.args += how.extra
        server.env = how.env(i)
        pair.append(server)
    try:
        start_all(pair, record)
        for rep in range(args.reps):
            for servers in ([pair[0]], pair):
                record.add({"server": "+".join(s.label for s in servers), "kind": "throughput", "rep": rep,
                            **asyncio.run(throughput(servers, 64, seed=500 + rep))})
    finally:
        for server in pair:
            server.stop()


def models_parser(description: str) -> argparse.ArgumentParser:
    """The arguments bench/gpu/servers.sh passes every script: the models and llama-server's binary."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--llama-server", dest="llama_server", required=True)
    return parser


def main() -> None:
    parser = models_parser(__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["layer", "replicas", "none"],
                        help=f"none, layer, row, or {', '.join(REPLICAS)}")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--long", type=int, default=65536, help="the long prompt's tokens (PFlash)")
    parser.add_argument("--beside", type=int, default=32768, help="the prompt prefilled beside the short ones")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    def run(arm: str, record: Record) -> None:
        if arm.startswith("replicas"):
            replicas(args, record, REPLICAS[arm])
        else:
            servers = [ours(f"ours-{arm}", args.port, args, arm),
                       llama_server(f"llama-server-{arm}", args.port + 1, args, arm),
                       llama_server(f"llama-server-{arm}-cache-ram-0", args.port + 2, args, arm, "--cache-ram", "0")]
            side_by_side(servers, args, record)

    run_arms(args.out, args.arms, run)


def run_arms(out: Path, arms: list[str], run: Callable[[str, Record], None]) -> None:
    """Each arm in turn into one results file (kept across calls, an arm run again replaced), written
    after every row; an arm that fails is on record and the next one still runs."""
    data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"results": {}}
    data["machine"] = machine()
    record = Record(out, data)
    for arm in arms:
        start = time.perf_counter()
        record.arm = arm
        data["results"].pop(arm, None)
        try:
            run(arm, record)
        except Exception as error:
            record.add({"kind": "error", "error": f"{type(error).__name__}: {error}"[:2000]})
        print(f"{arm}: {time.perf_counter() - start:.0f} s", flush=True)


def machine() -> dict[str, Any]:
    def run(*argv: str) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            return str(error)

    return {"gpus": run("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader").splitlines(),
            "topology": run("nvidia-smi", "topo", "-m"), "cpus": os.cpu_count(), "argv": sys.argv,
            "tree": os.environ.get("PFLASH_TREE")}  # the device's copy has no git: queue.sh passes the commit


if __name__ == "__main__":
    main()

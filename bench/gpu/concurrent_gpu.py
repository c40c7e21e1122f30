"""The seed's concurrent workloads on one GPU: ours (full prefill and PFlash, 4 slots; PFlash on
1 slot) against llama.cpp's llama-server (4 slots, `--cache-ram 0`), over HTTP, every request of a
workload sent at once; and a decode arm at 64 clients.

On the CUDA machine (bench/gpu/servers.sh builds llama-server, writes the models and runs this):
    bash bench/gpu/servers.sh bench/gpu/concurrent_gpu.py --out r.json [args...]

Workloads (random token-id prompts of the random-weight models; every request streamed, TTFT
counted from its sending, so queueing is included):
- qa8: 8 prompts of 22K tokens, 16 tokens out;
- mix8: 4 prompts of 22K tokens + 4 short ones (32 tokens out): the short ones' TTFT;
- cd4: 4 prompts of 84K tokens, 1,024 tokens out each.
Arms: `full` and `pflash` (one server of ours with 4 slots, per-request `pflash` mode off / always),
`llama-server` (`-np 4 --cache-ram 0`, a KV stream per slot as llama-server defaults to) and
`serial-pflash` (ours, 1 slot, PFlash): group `seed`, issue 28's bench. The GPU cannot hold the
three servers at once (8B F16 target ~15 GiB each, KV 128 KiB a token: 43 GiB for 4 x 88K cells,
11 GiB for one; ours-4 ~63 GiB with its drafter, llama-server ~59, ours-serial ~31: ~153 GiB of
the H200's 139), so each rep runs two phases: ours-4 beside llama-server (full, pflash and
llama-server interleaved, workload by workload, their order rotated per rep), then ours-4 beside
ours-serial (llama-server stopped for it); each phase records the GPU memory its servers hold
(`kind: memory`), and `--llama_server_apart` gives llama-server a phase of its own should ours-4 and
it not fit together after all. Other groups, one server each, for A/Bs:
`ours-unified` (`--kv_layout unified`), `ours-one-lane` (`--pflash_drafter_lanes 1`), `polite-S`
(PFlash only, `--pflash_polite_s S`); `upstream`: ours-4 (full, PFlash) beside llama-cpp-python's
own example server (bench/upstream.py: 4 sequences, a KV stream each).
Every request draws its prompt from a seed of its arm, workload and rep, so no prompt repeats and
our prefix cache never serves one from an earlier arm or rep; `--first_rep N` numbers the reps from
N, so a second run (another device call) continues with new prompts, into its own file (the report
merges files). Ours' requests carry `stream_options.include_usage`: each row keeps the server's
TTFT (`server_ttft_*`, arrival to first token) beside the client's, the marks around it where the
server reports them (`prepare_*`: headers in to arrival; `release_*`: first token to its event leaving
the engine thread; `emit_*`: that to its text written),
and how many prompts PFlash compressed. Ours runs with `--usage_clock`: its rows' `timeline` lays each
request on the client's clock, ms after the workload's start: `sent`, `client_first` (its first text
read) and the server's marks (`received` ... `first_written`, `finished`; issue 48: where mix8's
short requests wait, and where the long ones are meanwhile).
`--spy MODE...` records ours' server with py-spy (bundled in .gpu/wheels) over each rep's mix8 on the
`full` arm, the modes taking turns per rep: `idle` (every thread, waiting or not, 2 kHz, the process
left running) and `native` (every thread with its C frames, 1 kHz, the process paused per sample: a
thread waiting for the GIL shows as a condition wait under the call it returns from), each a chrometrace
timeline in `spy/` beside the results, read by bench/gpu/spy_report.py (issue 48 item 4: where the short
requests' first token waits on a GPU host; docs/first_token_cpu.md).
(py-spy's `--gil` is no use here: a timeline merges a thread's samples across the gaps where it
did not hold the GIL.)
Arm `decode64`: 64 clients x 2 requests of 128 tokens, ours (64 slots) against llama-server
(`-np 64 --cache-ram 0`), interleaved reps; run it with the models of a 128K-token vocabulary.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from multi_gpu import (Record, Server, body, client, log_dir, models_parser, run_arms, start_all, stream_times,
                       streamed, throughput, token_ids)
from harness import on_clock
from upstream import UpstreamServer, model_options

WORKLOADS = {  # name: (long prompts, their tokens, tokens out, short prompts, short tokens out)
    "qa8": (8, 22528, 16, 0, 0),
    "mix8": (4, 22528, 32, 4, 32),
    "cd4": (4, 86016, 1024, 0, 0),
}
N_CTX = 88064  # a slot's max_ctx: cd4's prompt + its 1,024 tokens out, in whole 256-token streams
SLOTS = 4


@dataclass
class Arm:
    """A column of the bench: a server and the per-request PFlash mode sent to it (None: llama-server)."""

    name: str
    server: Server
    mode: str | None


@dataclass
class Phase:
    """Servers up together (they fit the GPU together) and the arms run on them, in turn."""

    servers: list[Server]
    arms: list[Arm]


def ours(label: str, port: int, args: argparse.Namespace, slots: int, *extra: str) -> Server:
    chunk = [] if args.prefill_chunk is None else ["--prefill_chunk", str(args.prefill_chunk)]
    return Server(label, [
        "--model", args.target, "--n_gpu_layers", "-1", "--n_ctx", str(n_ctx(args)), "--max_concurrency", str(slots),
        "--n_batch", "2048", "--n_ubatch", "512", "--flash_attn", "true", *chunk,
        "--pflash", "always", "--pflash_drafter", args.drafter, "--pflash_keep_ratio", "0.1", "--usage_clock", "true",
        *extra,
    ], port=port, log_dir=log_dir(args), ours=True)


def ours_serial(args: argparse.Namespace) -> Server:
    """Serial PFlash: ours with one slot."""
    return ours("ours-serial", args.port + 1, args, 1)


def n_ctx(args: argparse.Namespace) -> int:
    """A slot's context: --slot_ctx, else cd4's (times --scale), in whole 256-token streams."""
    tokens = getattr(args, "slot_ctx", None) or int(N_CTX * args.scale)
    return -(-tokens // 256) * 256


def llama_server(label: str, port: int, args: argparse.Namespace, slots: int, slot_ctx: int) -> Server:
    return Server(label, [
        "-m", args.target, "--host", "127.0.0.1", "-ngl", "999", "-c", str(slot_ctx * slots), "-np", str(slots),
        "-b", "2048", "-ub", "512", "-fa", "on", "--cache-ram", "0",
    ], program=[args.llama_server], port=port, log_dir=log_dir(args))


def upstream(args: argparse.Namespace) -> UpstreamServer:
    """llama-cpp-python's own example server (bench/upstream.py) with 4 sequences of a slot's cells
    each, a KV stream per sequence (`kv_unified` false: what llama-server defaults to, and what long
    prompts side by side need; one unified pool made four 84K prefills 5x slower in ours)."""
    options = model_options(args.target, slots=SLOTS, n_ctx=SLOTS * n_ctx(args), gpu=True)
    return UpstreamServer("upstream", [], port=args.port + 8, log_dir=log_dir(args),
                          options={**options, "kv_unified": False})


def request(server: Server, prompt: list[int], max_tokens: int, mode: str | None) -> bytes:
    """A streamed body; ours' asks for the usage chunk, which carries the server's timings."""
    extra = {"stream_options": {"include_usage": True}} if server.ours else {}
    return streamed(body(server, prompt, max_tokens, pflash=mode, **extra))


def mean(values: list[float]) -> float:
    return round(statistics.mean(values), 4)


async def workload(arm: Arm, name: str, rep: int, scale: float) -> dict[str, Any]:
    """Every request of the workload at once; wall time, the long and the short ones' mean TTFT (the
    client's, and the server's where it reports one)."""
    n_long, long_tokens, long_out, n_short, short_out = WORKLOADS[name]
    long_tokens, long_out = int(long_tokens * scale), max(int(long_out * scale), 2)
    seed = f"{arm.name}/{name}/{rep}"
    rng = random.Random(seed)
    longs = [request(arm.server, token_ids(long_tokens, rng), long_out, arm.mode) for _ in range(n_long)]
    shorts = [request(arm.server, token_ids(32, rng), short_out, arm.mode) for _ in range(n_short)]
    async with client() as http:
        start = time.perf_counter()

        async def timed(body: bytes) -> tuple[float, dict[str, Any] | None, float, float]:
            sent = time.perf_counter()
            first, usage = await stream_times(http, arm.server, body)
            return first, usage, time.perf_counter() - start, sent

        done = await asyncio.gather(*(timed(r) for r in longs + shorts))
        wall = time.perf_counter() - start
    ttfts = [t for t, _, _, _ in done]
    # the long answers' time per token after the first: what a prefill beside them costs their decode
    itl = [(end - first) / (long_out - 1) for first, _, end, _ in done[:n_long]]
    row: dict[str, Any] = {"workload": name, "seed": seed, "wall_s": round(wall, 3), "ttft_mean_s": mean(ttfts[:n_long]),
                           "ttft_max_s": round(max(ttfts[:n_long]), 3), "itl_mean_ms": round(1000 * statistics.mean(itl), 2)}
    if n_short:
        row["short_ttft_mean_s"] = mean(ttfts[n_long:])
    timings = [usage["timings"] for _, usage, _, _ in done if usage and "timings" in usage]
    if any("clock" in t for t in timings):  # ours (--usage_clock): every request's stages, ms after the start
        row["timeline"] = [{"kind": "long" if i < n_long else "short", "sent": round(1000 * (sent - start), 2),
                            "client_first": round(1000 * (sent + first - start), 2), **on_clock(usage, start)}
                           for i, (first, usage, _, sent) in enumerate(done)]
        if n_short:  # what the server's marks leave of the short ones' client TTFT: before its headers, after its text
            shorts = [t for t in row["timeline"][n_long:] if "received" in t and "first_written" in t]
            row["short_in_mean_s"] = mean([(t["received"] - t["sent"]) / 1000 for t in shorts])
            row["short_out_mean_s"] = mean([(t["client_first"] - t["first_written"]) / 1000 for t in shorts])
    if len(timings) == len(done):  # ours
        server = [t["ttft_ms"] / 1000 for t in timings]
        row |= {"server_ttft_mean_s": mean(server[:n_long]), "server_ttft_max_s": round(max(server[:n_long]), 3),
                "compressed": sum((t.get("pflash") or {}).get("status") == "compressed" for t in timings)}
        if n_short:
            row["server_short_ttft_mean_s"] = mean(server[n_long:])
        for mark in ("prepare_ms", "queue_ms", "release_ms", "emit_ms"):  # around the engine's TTFT (issue 48)
            if all(mark in t for t in timings):
                values = [t[mark] / 1000 for t in timings]
                row[f"{mark[:-3]}_mean_s"] = mean(values[:n_long])
                if n_short:
                    row[f"short_{mark[:-3]}_mean_s"] = mean(values[n_long:])
    return row


def bring_up(up: dict[str, Server], wanted: list[Server], record: Record) -> None:
    """Stop the servers up that `wanted` leaves out (first: their memory), then start the rest of it
    and record the GPU memory the phase's servers hold."""
    labels = {server.label for server in wanted}
    for label in [label for label in up if label not in labels]:
        up.pop(label).stop()
    start_all([server for server in wanted if server.label not in up], record, ready_s=600.0)
    up.update((server.label, server) for server in wanted)
    record.add({"kind": "memory", "servers": sorted(labels), "gpu_mib_used": gpu_mib_used()})


def gpu_mib_used() -> list[int] | None:
    """Each GPU's used memory (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [int(line) for line in out.split()] or None


SPY_FLAGS = {"idle": ["--idle", "--nonblocking", "--rate", "2000"], "native": ["--idle", "--native", "--rate", "1000"]}


@contextlib.contextmanager
def spied(server: Server, mode: str, out: Path) -> Iterator[dict[str, Any]]:
    """py-spy recording `server` (4 s, a chrometrace timeline) while the block runs; yields
    the row's keys: the file, and the wall clock when py-spy was started and when the block began
    (py-spy's timestamps count from its own start, give or take its attach)."""
    assert server.proc is not None
    spy = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
    out.parent.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    proc = subprocess.Popen([spy, "record", "--pid", str(server.proc.pid), "--duration", "4",
                             "--threads", "--format", "chrometrace", "--output", str(out), *SPY_FLAGS[mode]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached and sampling before the first request
    keys = {"spy": out.name, "spy_mode": mode, "spy_launched": launched, "spy_block": time.time()}
    try:
        yield keys
    finally:
        try:
            _, err = proc.communicate(timeout=30)
            if proc.returncode:
                keys["spy_error"] = err.decode(errors="replace")[-500:]
        except subprocess.TimeoutExpired:
            proc.kill()
            keys["spy_error"] = "py-spy did not end"


def run_phases(phases: list[Phase], args: argparse.Namespace, record: Record) -> None:
    """Per rep and phase, the phase's servers up, then per workload each of its arms in turn, their
    order rotated per rep."""
    up: dict[str, Server] = {}
    try:
        for rep in range(args.first_rep, args.first_rep + args.reps):
            for phase in phases:
                bring_up(up, phase.servers, record)
                turn = rep % len(phase.arms)
                for name in args.workloads:
                    for arm in phase.arms[turn:] + phase.arms[:turn]:
                        spy = args.spy and arm.name == "full" and name == "mix8"
                        mode = args.spy[rep % len(args.spy)] if spy else ""
                        with (spied(arm.server, mode, args.out.parent / "spy" / f"mix8_{rep}_{mode}.json")
                              if spy else contextlib.nullcontext({})) as keys:
                            row = asyncio.run(workload(arm, name, rep, args.scale))
                        record.add({"arm": arm.name, "rep": rep, **row, **keys})
    finally:
        for server in up.values():
            server.stop()


def decode64(args: argparse.Namespace, record: Record) -> None:
    """64 clients on ours and on llama-server, reps interleaved (both up at once: small KV)."""
    servers = [Server("ours-64", ["--model", args.target, "--n_gpu_layers", "-1", "--n_ctx", "512",
                                  "--max_concurrency", "64", "--max_queue", "256", "--n_batch", "2048",
                                  "--n_ubatch", "512", "--flash_attn", "true"],
                      port=args.port + 5, log_dir=log_dir(args), ours=True),
               llama_server("llama-server-64", args.port + 6, args, 64, 512)]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(600.0)
            asyncio.run(throughput([server], 8, seed=1))
        for rep in range(args.first_rep, args.first_rep + args.reps):
            for server in servers:
                record.add({"arm": server.label, "rep": rep, **asyncio.run(throughput([server], 64, seed=50 + rep))})
    finally:
        for server in servers:
            server.stop()


BESIDE = {  # --NAME_arm: a second ours-4 beside ours-4 (group seed and peer): its port offset, flags, arms
    "gil": (8, ["--gil_switch_ms", "0.5"], [("full", "off"), ("pflash", "always")]),  # a 0.5 ms switch interval
    "eager": (9, ["--polite_prepare_ms", "0"], [("full", "off")]),  # preparation not waiting for a first token
    "cold": (10, ["--warmup", "false"], [("full", "off")]),  # no start-up warm-up (the first burst pays it)
    "classic": (11, ["--http", "h11", "--loop", "asyncio"], [("full", "off")]),  # uvicorn's pure-Python parser, asyncio
    # the prefill cap not grown while few answers decode (the GPU's rule before session 74's --prefill_per_answer)
    "pa0": (12, ["--prefill_per_answer", "0"], [("full", "off")]),
}


def one_server(server: Server, *arms: tuple[str, str]) -> list[Phase]:
    return [Phase([server], [Arm(name, server, mode) for name, mode in arms])]


def groups(args: argparse.Namespace, group: str) -> list[Phase]:
    """A group's phases."""
    if group in ("seed", "peer"):  # ours-4 stays up; llama-server and ours-serial (seed) take turns beside it
        four = ours("ours-4", args.port, args, SLOTS)
        first = Phase([four], [Arm("full", four, "off"), Arm("pflash", four, "always")])
        phases = [first]
        for name, (port, flags, modes) in BESIDE.items():
            if getattr(args, f"{name}_arm"):
                second = ours(f"ours-4-{name}", args.port + port, args, SLOTS, *flags)
                first.servers.append(second)
                first.arms += [Arm(f"{mode_name}-{name}", second, mode) for mode_name, mode in modes]
        if group == "seed":
            serial = ours_serial(args)
            phases.append(Phase([four, serial], [Arm("serial-pflash", serial, "always")]))
        if args.llama_server != "none":
            peer = llama_server("llama-server", args.port + 3, args, SLOTS, n_ctx(args))
            if args.llama_server_apart:  # a phase of its own: ours stopped for it, restarted for the next rep
                phases.append(Phase([peer], [Arm("llama-server", peer, None)]))
            else:
                first.servers.append(peer)
                first.arms.append(Arm("llama-server", peer, None))
        return phases
    if group == "upstream":  # ours-4 beside llama-cpp-python's own example server
        four, peer = ours("ours-4", args.port, args, SLOTS), upstream(args)
        return [Phase([four, peer], [Arm("full", four, "off"), Arm("pflash", four, "always"),
                                     Arm("upstream", peer, None)])]
    if group == "serial":  # the seed's serial PFlash alone
        return one_server(ours_serial(args), ("serial-pflash", "always"))
    if group == "ours-unified":
        return one_server(ours("ours-4-unified", args.port + 2, args, SLOTS, "--kv_layout", "unified"),
                          ("full-unified", "off"), ("pflash-unified", "always"))
    if group == "ours-one-lane":
        return one_server(ours("ours-4-one-lane", args.port + 4, args, SLOTS, "--pflash_drafter_lanes", "1"),
                          ("pflash-one-lane", "always"))
    if group.startswith("polite-"):  # a PFlash server whose drafts step aside for `bound` s at most
        bound = group[len("polite-"):]
        return one_server(ours(f"ours-4-{group}", args.port + 7, args, SLOTS, "--pflash_polite_s", bound),
                          (f"pflash-{group}", "always"))
    raise ValueError(f"unknown group {group!r}")


def main() -> None:
    parser = models_parser(__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", default=["seed"],
                        help="seed (ours full, ours PFlash, llama-server, then serial PFlash; llama-server left out with "
                        "--llama-server none), peer (seed without serial PFlash), serial (serial PFlash alone), "
                        "upstream (ours full and PFlash beside llama-cpp-python's example server), "
                        "ours-unified, ours-one-lane, polite-S, decode64")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--first_rep", type=int, default=0, help="the first rep's number: a later run's new prompts")
    parser.add_argument("--eager_arm", action="store_true",
                        help="a second ours-4 with --polite_prepare_ms 0 (full prefill; the default was 0 before "
                        "session 69): fits an H100 with --llama_server_apart and --slot_ctx 22560, as --gil_arm")
    parser.add_argument("--gil_arm", action="store_true",
                        help="seed and peer: ours-4 with --gil_switch_ms 0.5 beside ours-4 (arms full-gil, pflash-gil)")
    parser.add_argument("--cold_arm", action="store_true",
                        help="seed and peer: ours-4 with --warmup false beside ours-4 (arm full-cold; with "
                        "--llama_server_apart every rep is a fresh server's first burst)")
    parser.add_argument("--classic_arm", action="store_true",
                        help="seed and peer: ours-4 with --http h11 --loop asyncio beside ours-4 (arm full-classic: "
                        "the server before httptools and uvloop)")
    parser.add_argument("--pa0_arm", action="store_true",
                        help="seed and peer: ours-4 with --prefill_per_answer 0 beside ours-4 (arm full-pa0: the "
                        "512 cap not grown while few answers decode, the GPU's rule before session 74)")
    parser.add_argument("--prefill_chunk", type=int, default=None, help="ours' --prefill_chunk (default: the server's)")
    parser.add_argument("--llama_server_apart", action="store_true",
                        help="seed: llama-server in a phase of its own (should ours-4 and it not fit the GPU together)")
    parser.add_argument("--spy", nargs="*", default=[], choices=list(SPY_FLAGS),
                        help="py-spy over mix8 on the full arm, these modes taking turns per rep (timelines in spy/)")
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--scale", type=float, default=1.0, help="prompt and output sizes times this (a CPU smoke test)")
    parser.add_argument("--slot_ctx", type=int, default=None,
                        help="each server's context per slot (default: cd4's 88,064 times --scale); mix8 alone needs "
                        "22,560: a quarter of the KV, so that --gil_arm's second server fits beside llama-server")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    def run(group: str, record: Record) -> None:
        if group == "decode64":
            decode64(args, record)
        else:
            run_phases(groups(args, group), args, record)

    run_arms(args.out, args.groups, run)


if __name__ == "__main__":
    main()

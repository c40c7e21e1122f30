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
Arms: `serial-pflash` (ours, 1 slot, PFlash), `full` and `pflash` (one server of ours with 4 slots,
per-request `pflash` mode off / always), `pflash-one-lane` (the same with `--pflash_drafter_lanes 1`),
`pflash-polite-S` (group `polite-S`: 4 slots, PFlash only, `--pflash_polite_s S`), `llama-server` (`-np 4 --cache-ram 0`, a KV stream per
slot as llama-server defaults to). Servers that fit the GPU together run their arms interleaved,
workload by workload.
Arm `decode64`: 64 clients x 2 requests of 128 tokens, ours (64 slots) against llama-server
(`-np 64 --cache-ram 0`), interleaved reps; run it with the models of a 128K-token vocabulary.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

from multi_gpu import (Record, Server, body, client, first_token_s, log_dir, models_parser, run_arms, start_all,
                       streamed, throughput, token_ids)

WORKLOADS = {  # name: (long prompts, their tokens, tokens out, short prompts, short tokens out)
    "qa8": (8, 22528, 16, 0, 0),
    "mix8": (4, 22528, 32, 4, 32),
    "cd4": (4, 86016, 1024, 0, 0),
}
N_CTX = 88064  # a slot's max_ctx: cd4's prompt + its 1,024 tokens out, in whole 256-token streams
SLOTS = 4


def ours(label: str, port: int, args: argparse.Namespace, slots: int, *extra: str) -> Server:
    return Server(label, [
        "--model", args.target, "--n_gpu_layers", "-1", "--n_ctx", str(n_ctx(args)), "--max_concurrency", str(slots),
        "--n_batch", "2048", "--n_ubatch", "512", "--flash_attn", "true", "--prefill_chunk", str(args.prefill_chunk),
        "--pflash", "always", "--pflash_drafter", args.drafter, "--pflash_keep_ratio", "0.1", *extra,
    ], port=port, log_dir=log_dir(args), ours=True)


def n_ctx(args: argparse.Namespace) -> int:
    return -(-int(N_CTX * args.scale) // 256) * 256


def llama_server(label: str, port: int, args: argparse.Namespace, slots: int, slot_ctx: int) -> Server:
    return Server(label, [
        "-m", args.target, "--host", "127.0.0.1", "-ngl", "999", "-c", str(slot_ctx * slots), "-np", str(slots),
        "-b", "2048", "-ub", "512", "-fa", "on", "--cache-ram", "0",
    ], program=[args.llama_server], port=port, log_dir=log_dir(args))


async def workload(server: Server, name: str, pflash: str | None, seed: int, scale: float) -> dict[str, Any]:
    """Every request of the workload at once; wall time, mean TTFT of the long and the short ones."""
    n_long, long_tokens, long_out, n_short, short_out = WORKLOADS[name]
    long_tokens, long_out = int(long_tokens * scale), max(int(long_out * scale), 2)
    rng = random.Random(seed)
    longs = [streamed(body(server, token_ids(long_tokens, rng), long_out, pflash=pflash)) for _ in range(n_long)]
    shorts = [streamed(body(server, token_ids(32, rng), short_out, pflash=pflash)) for _ in range(n_short)]
    async with client() as http:
        start = time.perf_counter()
        ttfts = await asyncio.gather(*(first_token_s(http, server, r) for r in longs + shorts))
        wall = time.perf_counter() - start
    row = {"workload": name, "wall_s": round(wall, 3), "ttft_mean_s": round(statistics.mean(ttfts[:n_long]), 3),
           "ttft_max_s": round(max(ttfts[:n_long]), 3)}
    if n_short:
        row["short_ttft_mean_s"] = round(statistics.mean(ttfts[n_long:]), 4)
    return row


def arms_of(server: Server) -> list[tuple[str, str | None]]:
    """(arm, per-request pflash mode) that a server runs."""
    if not server.ours:
        return [("llama-server", None)]
    if server.label == "ours-serial":
        return [("serial-pflash", "always")]
    if server.label == "ours-4-one-lane":
        return [("pflash-one-lane", "always")]
    if server.label.startswith("ours-4-polite-"):
        return [(f"pflash-{server.label[len('ours-4-'):]}", "always")]
    return [("full", "off"), ("pflash", "always")]


def run_group(servers: list[Server], args: argparse.Namespace, record: Record) -> None:
    """The servers up together; per rep and workload, each arm in turn."""
    try:
        start_all(servers, record, ready_s=600.0)
        for rep in range(args.reps):
            for name in args.workloads:
                for server in servers:
                    for arm, mode in arms_of(server):
                        record.add({"arm": arm, "rep": rep, **asyncio.run(workload(server, name, mode, 10 * rep, args.scale))})
    finally:
        for server in servers:
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
        for rep in range(args.reps):
            for server in servers:
                record.add({"arm": server.label, "rep": rep, **asyncio.run(throughput([server], 64, seed=50 + rep))})
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    parser = models_parser(__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", default=["ours", "llama-server"],
                        help="ours (4 slots + serial), ours-unified (4 slots, --kv_layout unified), ours-one-lane (4 slots, "
                        "PFlash drafting in one lane), polite-S (4 slots, PFlash only, --pflash_polite_s S), "
                        "llama-server, decode64")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--prefill_chunk", type=int, default=512)
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--scale", type=float, default=1.0, help="prompt and output sizes times this (a CPU smoke test)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    groups = {
        "ours": lambda: [ours("ours-4", args.port, args, SLOTS), ours("ours-serial", args.port + 1, args, 1)],
        "ours-unified": lambda: [ours("ours-4-unified", args.port + 2, args, SLOTS, "--kv_layout", "unified")],
        "ours-one-lane": lambda: [ours("ours-4-one-lane", args.port + 4, args, SLOTS, "--pflash_drafter_lanes", "1")],
        "llama-server": lambda: [llama_server("llama-server", args.port + 3, args, SLOTS, n_ctx(args))],
    }

    def polite(bound: str) -> list[Server]:  # a PFlash server whose drafts step aside for `bound` s at most
        return [ours(f"ours-4-polite-{bound}", args.port + 7, args, SLOTS, "--pflash_polite_s", bound)]

    def run(group: str, record: Record) -> None:
        if group == "decode64":
            decode64(args, record)
        else:
            run_group(polite(group[len("polite-"):]) if group.startswith("polite-") else groups[group](), args, record)

    run_arms(args.out, args.groups, run)

if __name__ == "__main__":
    main()

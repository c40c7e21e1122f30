"""PFlash's speedup over HTTP as a user runs it: one server per arm, `--pflash auto` (its start-up
calibration logged), full prefill (per-request `pflash: {"mode": "off"}`) and PFlash interleaved per
rep on fresh random prompts, the client's wall time for `max_tokens` 1, and the server's `draft_ms`.

    python bench/gpu/pflash_http.py --target T.gguf --drafter D.gguf --out r.json
        [--arms drafter self-default] [--lengths 65536 131072] [--reps 3 2]

Arms: `drafter` (`--pflash_drafter D.gguf`, cut to its scoring layers by default) and `self-default`
(no drafter: the target stopped at its default layer); after either, `-nopin` turns the drafter's
pinned KV view off (`--pflash_drafter_pin_view off`) and `-l<N>` drafts in N lanes
(`--pflash_drafter_lanes N`), e.g. `drafter-l2`; without it the server's default (4 lanes on a GPU).
Medians per arm and length.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
from pathlib import Path
from typing import Any

import httpx
from multi_gpu import Server, body, client, complete, log_dir, long_prompt, token_ids

KEEP = 0.1


def server(arm: str, args: argparse.Namespace, port: int) -> Server:
    longest = max(args.lengths)
    flags = ["--model", args.target, "--n_gpu_layers", "-1", "--n_ctx", str(longest + 1024), "--max_concurrency", "1",
             "--n_batch", "2048", "--n_ubatch", "512", "--flash_attn", "true", "--pflash", "auto",
             "--pflash_keep_ratio", str(KEEP)]
    if arm.startswith("drafter"):
        flags += ["--pflash_drafter", args.drafter]
    if "-nopin" in arm:
        flags += ["--pflash_drafter_pin_view", "off"]
    lanes = re.search(r"-l(\d+)", arm)
    if lanes:
        flags += ["--pflash_drafter_lanes", lanes.group(1)]
    return Server(arm, flags, port=port, log_dir=log_dir(args), ours=True)


async def measure(srv: Server, lengths: list[int], reps: list[int], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    async with client() as http:
        await complete(http, srv, body(srv, token_ids(2048, rng), 1, pflash="always"))  # warm both paths up
        await complete(http, srv, body(srv, token_ids(2048, rng), 1, pflash="off"))
    for n, n_reps in zip(lengths, reps):
        for rep in range(n_reps):
            timed = await long_prompt(srv, rng.randrange(2**31), n)  # full prefill, then PFlash
            report = timed["pflash_report"]
            full, pflash = timed["full_s"], timed["pflash_s"]
            row = {"arm": srv.label, "tokens": n, "rep": rep, "full_s": full, "pflash_s": pflash,
                   "speedup": round(full / pflash, 2), "draft_ms": report.get("draft_ms"),
                   "draft_us_per_token": round(1000 * report["draft_ms"] / n, 2) if report.get("draft_ms") else None,
                   "kept_tokens": report.get("kept_tokens"), "status": report.get("status")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def auto_decision(srv: Server) -> dict[str, Any]:
    """`--pflash auto`'s start-up decision: /status's threshold and measurement, and the log's lines."""
    models = list(httpx.get(srv.url + "/status", timeout=30).json()["models"].values())
    status = {key: value for key, value in models[0].items() if key.startswith("pflash")}
    text = srv.log_path.read_text(errors="replace") if srv.log_path.exists() else ""
    lines = [line.strip() for line in text.splitlines() if re.search(r"calibrat|compresses only", line, re.I)]
    return {"status": status, "log": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--arms", nargs="+", default=["drafter", "self-default"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--reps", type=int, nargs="+", default=[3, 2], help="per length")
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    reps = (args.reps * len(args.lengths))[:len(args.lengths)] if len(args.reps) == 1 else args.reps
    rows, calibrations = [], {}
    for i, arm in enumerate(args.arms):
        srv = server(arm, args, args.port + i)
        srv.start(timeout_s=300)
        try:
            calibrations[arm] = auto_decision(srv)
            rows += asyncio.run(measure(srv, args.lengths, reps, seed=i))
        finally:
            srv.stop()
        print(json.dumps({"arm": arm, "calibration": calibrations[arm]}), flush=True)
    summary = []
    for arm in args.arms:
        for n in args.lengths:
            mine = [r for r in rows if r["arm"] == arm and r["tokens"] == n]
            summary.append({"arm": arm, "tokens": n, "reps": len(mine),
                            **{key: statistics.median(r[key] for r in mine)
                               for key in ("full_s", "pflash_s", "speedup", "draft_ms", "draft_us_per_token")}})
            print(json.dumps(summary[-1]), flush=True)
    args.out.write_text(json.dumps({"rows": rows, "summary": summary, "calibration": calibrations}, indent=1))


if __name__ == "__main__":
    main()

"""Prefill time of long prompts over HTTP, `--swa_full true` against `false` (docs/prefix_reuse.md):
both servers up at once, interleaved reps, each rep a distinct prompt (no prefix reuse), the same in both
arms, max_tokens 1.

    python bench/swa_prefill.py --model MODEL.gguf [--words 1270] [--reps 3] [--n_ctx 16384]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import IO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(model: str, n_ctx: int, swa_full: bool, port: int, log: IO[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pflash_plugin.server", "--model", model, "--n_ctx", str(n_ctx),
           "--max_concurrency", "1", "--swa_full", str(swa_full).lower(), "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait(port: int, timeout_s: float = 600) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"no server on port {port}")


def prompt(rep: int, n_words: int) -> str:
    """A distinct prompt per rep from its first tokens on (about 4.8 tokens a word on Gemma 3)."""
    return f"Rep {rep}. " + " ".join(f"w{(rep * 7919 + i * 31) % 5000}" for i in range(n_words))


def prefill(port: int, text: str) -> tuple[float, int]:
    body = json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    answer = json.load(urllib.request.urlopen(request, timeout=900))
    return time.perf_counter() - t0, int(answer["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--words", type=int, default=1270)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n_ctx", type=int, default=16384)
    args = ap.parse_args()
    ports = {arm: free_port() for arm in (True, False)}
    logs = {arm: open(f"swa_full_{str(arm).lower()}.log", "w") for arm in ports}
    servers = [start(args.model, args.n_ctx, arm, port, logs[arm]) for arm, port in ports.items()]
    try:
        for port in ports.values():
            wait(port)
        print("uptime before:", subprocess.check_output(["uptime"], text=True).strip(), flush=True)
        seconds: dict[bool, list[float]] = {arm: [] for arm in ports}
        for rep in range(args.reps):
            for arm in (True, False) if rep % 2 == 0 else (False, True):
                s, n = prefill(ports[arm], prompt(rep, args.words))
                seconds[arm].append(s)
                print(f"rep {rep} swa_full={arm}: {s:.2f} s, {n} prompt tokens", flush=True)
        print("uptime after:", subprocess.check_output(["uptime"], text=True).strip())
        for arm, values in seconds.items():
            print(f"swa_full={arm}: median {statistics.median(values):.2f} s {[round(v, 2) for v in values]}")
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()

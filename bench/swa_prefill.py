"""Prefill time of long prompts over HTTP, `--swa_full true` against `false` (docs/prefix_reuse.md):
both servers up at once, interleaved reps, each rep a distinct prompt (no prefix reuse), the same in both
arms, max_tokens 1.

    python bench/swa_prefill.py [--model MODEL.gguf] [--words 1270] [--reps 3] [--n_ctx 16384]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

from harness import ServerProcess, demo_model_path, uptime


def server(model: str, n_ctx: int, swa_full: bool) -> ServerProcess:
    return ServerProcess(f"swa-full-{str(swa_full).lower()}", [
        "--model", model, "--n_ctx", str(n_ctx), "--max_concurrency", "1", "--swa_full", str(swa_full).lower()])


def prompt(rep: int, n_words: int) -> str:
    """A distinct prompt per rep from its first tokens on (about 4.8 tokens a word on Gemma 3)."""
    return f"Rep {rep}. " + " ".join(f"w{(rep * 7919 + i * 31) % 5000}" for i in range(n_words))


def prefill(url: str, text: str) -> tuple[float, int]:
    body = json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    answer = json.load(urllib.request.urlopen(request, timeout=900))
    return time.perf_counter() - t0, int(answer["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="a GGUF (default: the demo model)")
    ap.add_argument("--words", type=int, default=1270)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n_ctx", type=int, default=16384)
    args = ap.parse_args()
    args.model = args.model or demo_model_path()
    servers = {arm: server(args.model, args.n_ctx, arm).launch() for arm in (True, False)}
    try:
        for proc in servers.values():
            proc.wait_ready(600)
        print("uptime before:", uptime(), flush=True)
        seconds: dict[bool, list[float]] = {arm: [] for arm in servers}
        for rep in range(args.reps):
            for arm in (True, False) if rep % 2 == 0 else (False, True):
                s, n = prefill(servers[arm].url, prompt(rep, args.words))
                seconds[arm].append(s)
                print(f"rep {rep} swa_full={arm}: {s:.2f} s, {n} prompt tokens", flush=True)
        print("uptime after:", uptime())
        for arm, values in seconds.items():
            print(f"swa_full={arm}: median {statistics.median(values):.2f} s {[round(v, 2) for v in values]}")
    finally:
        for proc in servers.values():
            proc.stop()


if __name__ == "__main__":
    main()

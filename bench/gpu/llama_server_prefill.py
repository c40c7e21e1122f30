"""Full prefill in llama.cpp's own llama-server: the anchor for PFlash's TTFT table.

    python bench/gpu/llama_server_prefill.py --server BIN --model T.gguf --out ls.json [--lengths ...]

One slot, flash attention, n_batch 2048 / n_ubatch 512 as in pflash_gpu.py; prompts of random
token ids, prompt cache off, one generated token; the server's own prompt_ms and the wall time.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

PORT = 8099
VOCAB = 1300  # the random-weight models of write_tiny_llama have about 1,341 tokens


def post(path: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def wait_ready(process: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("llama-server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    n_ctx = max(args.lengths) + 1024
    argv = [args.server, "-m", args.model, "-c", str(n_ctx), "-ngl", "999", "-fa", "on", "-b", "2048", "-ub", "512",
            "-np", "1", "--host", "127.0.0.1", "--port", str(PORT)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open("/tmp/llama-server.log", "w"))
    rows = []
    try:
        wait_ready(process)
        rng = random.Random(0)
        post("/completion", {"prompt": [rng.randrange(300, VOCAB) for _ in range(2048)], "n_predict": 1, "cache_prompt": False})
        for n in args.lengths:
            for rep in range(args.reps if n <= 65536 else 1):
                prompt = [rng.randrange(300, VOCAB) for _ in range(n)]
                start = time.perf_counter()
                reply = post("/completion", {"prompt": prompt, "n_predict": 1, "cache_prompt": False})
                rows.append({"tokens": n, "rep": rep, "wall_s": round(time.perf_counter() - start, 3),
                             "prompt_ms": reply["timings"]["prompt_ms"], "prompt_n": reply["timings"]["prompt_n"]})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        process.terminate()
        process.wait(30)
    summary = [{"tokens": n, "wall_s": statistics.median(r["wall_s"] for r in rows if r["tokens"] == n)} for n in args.lengths]
    args.out.write_text(json.dumps({"argv": argv, "rows": rows, "summary": summary}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

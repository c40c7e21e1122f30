"""Where ours' time goes in two spots of docs/concurrent_gpu.md: a decode step of 4 slots, and the
short requests of mix8 beside compressed long prompts. A probe, not a comparison.

On the CUDA machine, after `source bench/gpu/setup.sh` (it needs no llama-server):
    python bench/gpu/decode_probe.py --target T.gguf --drafter D.gguf --llama-server none --out r.json

- decode: 1 and 4 requests at once (512-token prompts, 256 tokens out, every token generated),
  streamed and not: the client's time from the first token to the last over the tokens after the
  first, and the server's own `decode_ms` per token (non-streamed).
- mix8: 4 prompts of 22K tokens compressed by PFlash beside 4 short ones sent at once, the short
  ones non-streamed, so that their `usage.timings` (queue, prefill, first token) say where their
  time went on the server, beside the client's wall time.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from concurrent_gpu import ours
from multi_gpu import Record, body, client, complete, machine, models_parser, token_ids

OUT_TOKENS = 256


async def decode(server, n: int, stream: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    requests = [body(server, token_ids(512, rng), OUT_TOKENS) for _ in range(n)]

    async def one(http, request) -> dict[str, float]:
        start = time.perf_counter()
        if not stream:
            usage = (await complete(http, server, request))["usage"]
            return {"client_s": time.perf_counter() - start, "decode_ms_per_token":
                    usage["timings"]["decode_ms"] / max(usage["completion_tokens"] - 1, 1)}
        first = last = None
        async with http.stream("POST", server.url + "/v1/completions", json={**request, "stream": True}) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    last = time.perf_counter()
                    first = first or last
        assert first is not None and last is not None
        return {"client_s": last - start, "decode_ms_per_token": 1000 * (last - first) / (OUT_TOKENS - 1)}

    async with client() as http:
        rows = await asyncio.gather(*(one(http, r) for r in requests))
    return {"kind": "decode", "requests": n, "stream": stream,
            "decode_ms_per_token": [round(r["decode_ms_per_token"], 2) for r in rows],
            "client_s": [round(r["client_s"], 3) for r in rows]}


async def mix(server, seed: int, long_tokens: int) -> dict[str, Any]:
    rng = random.Random(seed)
    longs = [body(server, token_ids(long_tokens, rng), 32, pflash="always") for _ in range(4)]
    shorts = [body(server, token_ids(32, rng), 32) for _ in range(4)]

    async def timed(http, request) -> dict[str, Any]:
        start = time.perf_counter()
        reply = await complete(http, server, request)
        timings = reply["usage"]["timings"]
        return {"client_s": round(time.perf_counter() - start, 4),
                **{k: timings.get(k) for k in ("queue_ms", "compress_ms", "prefill_ms", "ttft_ms", "decode_ms")}}

    async with client() as http:
        rows = await asyncio.gather(*(timed(http, r) for r in longs + shorts))
    return {"kind": "mix8", "long": rows[:4], "short": rows[4:]}


def main() -> None:
    parser = models_parser(__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--prefill_chunk", type=int, default=512)
    parser.add_argument("--scale", type=float, default=0.27)  # n_ctx of the slots: 23,808 tokens
    parser.add_argument("--long", type=int, default=22528, help="mix8's long prompts (tokens)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record = Record(args.out, {"results": {}, "machine": machine()}, arm="probe")
    server = ours("ours-probe", args.port, args, 4)
    try:
        server.launch()
        record.add({"kind": "start", "ready_s": round(server.wait_ready(600.0), 1)})
        asyncio.run(decode(server, 4, False, 0))  # warm
        for rep in range(2):
            for n in (1, 4):
                for stream in (False, True):
                    record.add({"rep": rep, **asyncio.run(decode(server, n, stream, 10 + rep))})
            record.add({"rep": rep, **asyncio.run(mix(server, 20 + rep, args.long))})
    finally:
        server.stop()
    print(json.dumps(record.data["results"], indent=1)[:3000])


if __name__ == "__main__":
    main()

"""Concurrent image + question chats (issue 46): ours (--mmproj, N + 1 slots) against llama.cpp's
llama-server (--mmproj, -np N + 1), over HTTP, N requests sent at once, each with its own random image
(no prefix or embedding cache serves one), streamed; then one text chat sent while N image
prefills run: its time to first token.

Random-weight models written here: `--shape tiny` (the tests' tiny llama + tiny LLaVA projector,
64 tokens an image: runs on a CPU in seconds), `--shape mid` (the tiny llama with a 12-block ViT at
224 px, 256 tokens an image: an encode takes a while on a CPU, the text chat beside shows whether the
engine kept stepping) or `--shape real` (an 8B-class F16 llama, tiled, and a LLaVA-1.5-shaped
projector: ViT-L/14 at 336 px, 24 blocks, 576 tokens an image, F16).

CPU (tiny shapes; add `--llama-server BIN` for that arm):
    python bench/vision.py --shape tiny --clients 2 4 --out bench/results/vision_cpu.json
On the H200 (llama-server built with mtmd, as bench/gpu/servers.sh builds it):
    python bench/vision.py --shape real --gpu --clients 8 32 --llama-server /path/to/llama-server \
        --out bench/results/vision_gpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from harness import REPO, ServerProcess, arm_items, machine, sse_events
from pflash_plugin.llama.tiny_gguf import cached_tiny_llama
from pflash_plugin.llama.tiny_projector import cached_tiny_projector
from pflash_plugin.testing.media_files import png

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"model": {}, "projector": {}, "max_tokens": 16, "ctx": 512},
    # the tiny text model with a ViT of some size (224 px, 256 tokens an image): encodes take long on a CPU
    "mid": {"model": {}, "projector": {"n_embd": 384, "n_head": 6, "n_ff": 1536, "n_layer": 12, "image_size": 224,
                                       "patch_size": 14, "n_mlp": 256}, "max_tokens": 16, "ctx": 1024},
    "real": {"model": {"n_layer": 32, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "n_ff": 14336, "f16": True,
                       "tiled": True, "n_ctx_train": 8192},
             "projector": {"n_embd_text": 4096, "n_embd": 1024, "n_head": 16, "n_ff": 4096, "n_layer": 24,
                           "image_size": 336, "patch_size": 14, "n_mlp": 4096, "f16": True},
             "max_tokens": 64, "ctx": 2048},
}


def models(shape: str) -> tuple[str, str, int]:
    spec = SHAPES[shape]
    side = spec["projector"].get("image_size", 64)
    return str(cached_tiny_llama(**spec["model"])), str(cached_tiny_projector(**spec["projector"])), side


def servers(args: argparse.Namespace, model: str, mmproj: str, slots: int) -> list[ServerProcess]:
    ctx = SHAPES[args.shape]["ctx"]
    gpu = ["--n_gpu_layers", "-1"] if args.gpu else []
    # one slot more than the image chats: the text chat sent beside them has one of its own
    ours = ["--model", model, "--mmproj", mmproj, "--model_alias", "m", "--max_concurrency", str(slots + 1),
            "--n_ctx", str(ctx), *gpu]
    out = [ServerProcess(f"vision-ours-{slots}", ours)]
    out += [ServerProcess(f"vision-ours-enc{n}-{slots}", [*ours, "--media_encoders", str(n)]) for n in args.encoders]
    for arm in args.ours_arms:  # NAME=ITEMS: ours with those flags and environment too (harness.arm_items)
        name, extra, env = arm_items(arm)
        out.append(ServerProcess(f"vision-ours-{name}-{slots}", [*ours, *extra], env=env))
    for arm in args.ours_trees:  # NAME=PATH: ours from another checkout (a commit's `git archive`), the same flags
        name, _, path = arm.partition("=")
        out.append(ServerProcess(f"vision-ours-{name}-{slots}", ours, cwd=Path(path).resolve()))
    if args.llama_server:
        out.append(ServerProcess(f"vision-llama-server-{slots}", [
            "-m", model, "--mmproj", mmproj, "-np", str(slots + 1), "-c", str((slots + 1) * ctx), "--cache-ram", "0",
            "--host", "127.0.0.1", *(["-ngl", "999"] if args.gpu else [])],
            program=[args.llama_server], ready_paths=("/health",)))
    return out


# The shapes' models share the tests' byte-fallback vocabulary (llama/tiny_gguf.py), its 256 byte tokens
# at ids 3-258. Their random weights favour byte tokens, whose text llama-server holds back until it
# is valid UTF-8 (a lead byte after a lead byte: ~20 tokens, or to the end, where it is dropped), so
# its first streamed text came long after its first token. Banned, every token is text on both servers.
NO_BYTES = {str(token): -100 for token in range(3, 259)}


def image_body(image: bytes, max_tokens: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "Describe the picture."}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "logit_bias": NO_BYTES, "stream": True,
            "stream_options": {"include_usage": True}}


async def timed(client: httpx.AsyncClient, url: str, body: dict[str, Any], sent: float,
                started: asyncio.Queue[float] | None = None) -> dict[str, Any]:
    """One streamed chat: its time to first content, the pieces it streamed, the tokens it
    generated (usage.completion_tokens, or llama-server's timings.predicted_n: pieces are not
    tokens, a server may send several in one) and the server's timings (ours: usage.timings;
    llama-server: the last chunk's timings)."""
    first, pieces, tokens = None, 0, None
    timings: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for data in sse_events(response):
            if data != "[DONE]":
                chunk = json.loads(data)
                timings = chunk.get("timings") or (chunk.get("usage") or {}).get("timings") or timings
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                choices = chunk.get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    pieces += 1
                    if first is None:
                        first = time.perf_counter()
                        if started is not None:
                            started.put_nowait(first)
    if tokens is None:
        tokens = timings.get("predicted_n", 0)
    return {"ttft_s": (first or time.perf_counter()) - sent, "pieces": pieces, "tokens": tokens, "timings": timings,
            "end": time.perf_counter()}


def server_status(url: str) -> dict[str, Any] | None:
    """Ours: the model's engine steps and media counters (/status); None for llama-server."""
    response = httpx.get(url + "/status", timeout=30)
    if response.status_code != 200 or "models" not in response.json():
        return None
    model = response.json()["models"]["m"]
    return {"steps": model["steps"], **(model.get("media") or {})}


def phases(before: dict[str, Any] | None, after: dict[str, Any] | None, wall: float,
           done: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a round's time went (ours): the media counters' differences over the round, per image
    and per call, and the requests' own timings (medians, ms)."""
    if before is None or after is None:
        return {}
    d = {key: after[key] - before[key] for key in after if isinstance(after[key], (int, float)) and key in before}
    encoded, calls, steps = max(d.get("encoded", 0), 1), max(d.get("decode_calls", 0), 1), max(d["steps"], 1)
    out = {"encoders": after.get("encoders"), "encoded": d.get("encoded"),
           "encode_ms_per_image": round(1000 * d.get("encode_s", 0) / encoded, 2),
           "encode_wait_ms_per_image": round(1000 * d.get("encode_wait_s", 0) / encoded, 2),
           "encode_busy_share": round(d.get("encode_s", 0) / wall / max(after.get("encoders") or 1, 1), 3),
           "tokenize_ms_per_image": round(1000 * d.get("tokenize_s", 0) / max(d.get("tokenized", 0), 1), 2),
           "media_tokens": d.get("media_tokens"), "media_decode_rows": d.get("decode_rows"),  # more rows: redone
           "media_decode_calls": d.get("decode_calls"), "media_pieces": d.get("decode_pieces"),
           "media_rows_per_call": round(d.get("decode_rows", 0) / calls, 1),
           "media_decode_ms_per_call": round(1000 * d.get("decode_s", 0) / calls, 2),
           "media_decode_share": round(d.get("decode_s", 0) / wall, 3),
           "engine_steps": d["steps"], "wall_ms_per_step": round(1000 * wall / steps, 2),
           **ubatch_split(d),
           **prepare_split(d)}
    for key in ("prepare_ms", "queue_ms", "prefill_ms", "decode_ms"):
        values = sorted(t["timings"][key] for t in done if key in t["timings"])
        if values:
            out[f"median_{key}"] = values[len(values) // 2]
    return out


def ubatch_split(d: dict[str, Any]) -> dict[str, Any]:
    """The round's llama_decode calls as llama.cpp cut them (llama/ubatches.py): ubatches per token
    batch (a step's) and per media call, and how many built a graph (not the ubatch before's reused;
    on a GPU no CUDA graph replay): each ubatch reads all the weights."""
    if "step_ubatches" not in d:
        return {}
    calls, media = max(d["step_calls"], 1), max(d.get("decode_calls", 0), 1)
    return {"step_ubatches_per_call": round(d["step_ubatches"] / calls, 2),
            "step_graphs_built_per_call": round((d["step_ubatches"] - d["step_graphs_reused"]) / calls, 2),
            "media_ubatches_per_call": round(d["decode_ubatches"] / media, 2),
            "media_graphs_built_per_call": round((d["decode_ubatches"] - d["decode_graphs_reused"]) / media, 2)}


PREPARE_PARTS = ("upload", "parse", "wait", "media", "tokenize", "work", "back")


def prepare_split(d: dict[str, Any]) -> dict[str, Any]:
    """A media request's preparation in parts, ms per request (/status media's prepare_* sums):
    the body's upload (headers to its last part read), its JSON parsed and validated, the wait for a preparation thread, the items read
    (base64, checks), libmtmd's tokenize, the thread's whole work (those two in it), the hop back."""
    n = d.get("prepared", 0)
    if not n:
        return {}
    return {f"prepare_{part}_ms": round(1000 * d.get(f"prepare_{part}_s", 0) / n, 2) for part in PREPARE_PARTS}


async def round_of(url: str, images: list[bytes], max_tokens: int) -> dict[str, Any]:
    """`images` chats at once, and a text chat 0.2 s after them."""
    text = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    before = await asyncio.to_thread(server_status, url)
    started: asyncio.Queue[float] = asyncio.Queue()
    async with httpx.AsyncClient(timeout=1800) as client:
        start = time.perf_counter()
        chats = [asyncio.create_task(timed(client, url, image_body(i, max_tokens), start, started)) for i in images]
        tail = asyncio.create_task(all_started(url, started, len(images)))
        await asyncio.sleep(0.2)
        beside = await timed(client, url, text, time.perf_counter())
        done = await asyncio.gather(*chats)
        wall = time.perf_counter() - start
        last_first, middle = await ended(tail)
    after = await asyncio.to_thread(server_status, url)
    pieces, tokens = sum(d["pieces"] for d in done), [d["tokens"] for d in done]
    return {"wall_s": round(wall, 3), "requests_per_s": round(len(images) / wall, 3),
            "pieces_per_s": round(pieces / wall, 2), "tokens": sum(tokens), "tokens_per_request": [min(tokens), max(tokens)],
            "tokens_per_s": round(sum(tokens) / wall, 1), "mean_ttft_s": round(sum(d["ttft_s"] for d in done) / len(done), 3),
            "text_ttft_beside_s": round(beside["ttft_s"], 3), "phases": phases(before, after, wall, done),
            "tail": decode_tail(middle, after, max(d["end"] for d in done) - last_first, done)}


async def ended(tail: asyncio.Task[tuple[float, dict[str, Any] | None]]) -> tuple[float, dict[str, Any] | None]:
    """`all_started`'s result once the chats are done (its /status read may still be under way), or
    now and None where a chat streamed no text at all (a server may hold back bytes that are not yet
    valid UTF-8 and drop them at the end: llama-server does): then there is no tail to measure."""
    await asyncio.wait({tail}, timeout=5.0)
    if tail.done():
        return tail.result()
    tail.cancel()
    return time.perf_counter(), None


async def all_started(url: str, started: asyncio.Queue[float], n: int) -> tuple[float, dict[str, Any] | None]:
    """When the last image chat had its first text, and the server's counters then (ours)."""
    last = 0.0
    for _ in range(n):
        last = await started.get()
    return last, await asyncio.to_thread(server_status, url)


def decode_tail(middle: dict[str, Any] | None, after: dict[str, Any] | None, tail_s: float,
                done: list[dict[str, Any]]) -> dict[str, Any]:
    """The round after every image chat had its first text: decode alone (the images are in), its ms
    a step where the server counts steps (ours), and a token of the longest answer (the last chat to
    start generates all of it in the tail, a token a step: any server)."""
    steps = (after["steps"] - middle["steps"]) if middle and after else None
    longest = max(d["tokens"] for d in done)
    paces = sorted(p for p in map(decode_pace, done) if p is not None)
    return {"tail_s": round(tail_s, 3) if tail_s > 0 else None, "steps": steps,
            "ms_per_step": round(1000 * tail_s / steps, 2) if steps else None,
            "ms_per_token": round(1000 * tail_s / (longest - 1), 2) if longest > 1 and tail_s > 0 else None,
            "server_ms_per_token": [round(paces[0], 2), round(paces[len(paces) // 2], 2), round(paces[-1], 2)]
            if paces else None}


def decode_pace(chat: dict[str, Any]) -> float | None:
    """A request's ms a token after its first, as its server timed it (llama-server's
    predicted_per_token_ms, ours' usage.timings decode_ms over its tokens less one): any server's
    decode pace, where a streamed answer's first text says nothing (llama-server holds back bytes
    that are not yet valid UTF-8, so a random model's answer may stream no text for many tokens)."""
    timings, tokens = chat["timings"], chat["tokens"]
    if "predicted_per_token_ms" in timings:
        return float(timings["predicted_per_token_ms"])
    if "decode_ms" in timings and tokens > 1:
        return float(timings["decode_ms"]) / (tokens - 1)
    return None


def run_arms(args: argparse.Namespace, arms: list[ServerProcess], slots: int, side: int) -> list[dict[str, Any]]:
    """The arms up at once, each warmed, their reps interleaved (a busy machine's drift falls on each alike)."""
    rows = []
    try:
        for server in arms:
            server.start(timeout_s=600)
            asyncio.run(round_of(server.url, [png(side, side, 10**6 + i) for i in range(slots)], 4))  # warm-up
        for rep in range(args.reps):
            images = [png(side, side, rep * 1000 + slots * 100 + i) for i in range(slots)]
            for server in arms:
                row = {"arm": server.label, "clients": slots, "rep": rep,
                       **asyncio.run(round_of(server.url, images, SHAPES[args.shape]["max_tokens"]))}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for server in arms:
            server.stop()
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """Per arm and client count: the median rep's requests/s, tokens/s and TTFTs, and that rep's
    phases. Requests/s compares arms only where each request generated its max_tokens (a server that
    ends answers early does less work): the median is of those reps, and `full reps` says how many."""
    lines = ["arm | clients | req/s (median) | full reps | tok/s | tokens a request | image TTFT s | text TTFT beside s "
             "| phases of that rep"]
    most = max(r["tokens_per_request"][1] for r in rows)
    for key in dict.fromkeys((r["arm"], r["clients"]) for r in rows):
        reps = sorted((r for r in rows if (r["arm"], r["clients"]) == key), key=lambda r: r["requests_per_s"])
        full = [r for r in reps if r["tokens_per_request"][0] == most]
        counted = full or reps
        mid = counted[len(counted) // 2]
        lines.append(f"{key[0]} | {key[1]} | {mid['requests_per_s']} | {len(full)}/{len(reps)} | {mid['tokens_per_s']} | "
                     f"{mid['tokens_per_request']} | "
                     f"{mid['mean_ttft_s']} | {mid['text_ttft_beside_s']} | {json.dumps(mid['phases'])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--llama-server", dest="llama_server")
    ap.add_argument("--encoders", type=int, nargs="*", default=[],
                    help="also ours with --media_encoders N, an arm each (the default arm: the server's auto)")
    ap.add_argument("--ours-arms", dest="ours_arms", nargs="*", default=[], metavar="NAME=FLAGS",
                    help="also ours with these server flags (commas for spaces; ENV:KEY=VALUE for its environment), an arm "
                         "each: nb2048=--n_batch,2048")
    ap.add_argument("--ours-trees", dest="ours_trees", nargs="*", default=[], metavar="NAME=PATH",
                    help="also ours from another checkout, an arm each (before/after a change: git archive "
                         "COMMIT | tar -x -C PATH, with its built pflash_plugin/_pflash_ext*.so copied in)")
    ap.add_argument("--one-at-a-time", dest="one_at_a_time", action="store_true",
                    help="one server up at a time, its reps back to back (a GPU's memory holds one), "
                         "instead of all arms up and their reps interleaved")
    ap.add_argument("--image-side", dest="image_side", type=int, default=0,
                    help="the PNGs' side in pixels (default: the projector's; 336 with --shape tiny sends the "
                         "real shape's bodies, ~450 KB, to the tiny model)")
    ap.add_argument("--target", "--drafter", dest="unused", help="(bench/gpu/servers.sh passes them; --shape writes its models)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vision.json")
    args = ap.parse_args()
    model, mmproj, side = models(args.shape)
    side = args.image_side or side
    rows: list[dict[str, Any]] = []
    for slots in args.clients:
        arms = servers(args, model, mmproj, slots)
        for group in ([[arm] for arm in arms] if args.one_at_a_time else [arms]):
            rows += run_arms(args, group, slots, side)
    print(summary(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"bench": "vision", "shape": args.shape, "gpu": args.gpu, "machine": machine(),
            "command": " ".join(["python", "bench/vision.py", *sys.argv[1:]])}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

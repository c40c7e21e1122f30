"""PFlash under concurrent serving, three arms on the demo model in one run.

Arms (separate servers, driven in turn per workload so noise hits all alike):
  serial-pflash     1 slot,  PFlash on  (compress, then prefill, one request at a time)
  concurrent-full   4 slots, PFlash off (continuous batching, full prefill)
  concurrent-pflash 4 slots, PFlash on  (compression thread beside the decoding slots)
Workloads: qa8 (8 needle prompts of ~4K tokens, 4 in flight), qa8x8 (the same, 8 in flight),
mix8 (4 needle prompts + 4 short chats sent together; short-chat TTFT against an idle server).
Every answer is checked: the needle's code for long prompts, a non-empty reply for chats.

Usage: python bench/pflash_concurrent.py [--tokens 4096] [--keep 0.1]
Writes bench/results/concurrent.json, docs/concurrent.md and docs/concurrent.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from harness import REPO, ServerProcess, fit_prompt, machine, sse_events

ARMS = {
    "serial-pflash": ["--max_concurrency", "1", "--pflash", "always"],
    "concurrent-full": ["--max_concurrency", "4", "--pflash", "off"],
    "concurrent-pflash": ["--max_concurrency", "4", "--pflash", "always"],
}
CHATS = ["Tell me about rivers.", "Name a color.", "What is a bridge?", "Say hello to Mina."]


async def long_item(client: httpx.AsyncClient, url: str, prompt: str, code: str) -> dict:
    t0 = time.perf_counter()
    reply = (await client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})).json()
    if "choices" not in reply:
        raise RuntimeError(f"{url}: {reply}")
    return {"kind": "long", "ok": code in reply["choices"][0]["text"], "ttft_s": reply["usage"]["timings"]["ttft_ms"] / 1000,
            "done_s": time.perf_counter() - t0, "pflash": reply["usage"]["timings"].get("pflash", {}).get("status")}


async def chat_item(client: httpx.AsyncClient, url: str, text: str) -> dict:
    """Streamed chat: TTFT = first chunk with content, measured by the client."""
    t0 = time.perf_counter()
    ttft, content = None, ""
    # min_tokens: the base demo model may end a chat turn at once; the benchmark times a reply
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "min_tokens": 2, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for data in sse_events(response):
            if data == "[DONE]":
                continue
            delta = json.loads(data)["choices"][0]["delta"].get("content")
            if delta:
                ttft = ttft or time.perf_counter() - t0
                content += delta
    return {"kind": "chat", "ok": bool(content), "ttft_s": ttft or float("nan"), "done_s": time.perf_counter() - t0}


async def run_workload(url: str, longs: list[tuple[str, str]], chats: list[str], in_flight: int) -> dict:
    limit = asyncio.Semaphore(in_flight)

    async def bounded(coro):
        async with limit:
            return await coro

    async with httpx.AsyncClient(timeout=3600) as client:
        t0 = time.perf_counter()
        jobs = [bounded(long_item(client, url, p, c)) for p, c in longs] + [chat_item(client, url, t) for t in chats]
        items = await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
    longs_ = [i for i in items if i["kind"] == "long"]
    chats_ = [i for i in items if i["kind"] == "chat"]
    return {
        "wall_s": round(wall, 2), "all_ok": all(i["ok"] for i in items), "ok": sum(i["ok"] for i in items), "items": len(items),
        "mean_ttft_s": round(statistics.mean(i["ttft_s"] for i in longs_), 2) if longs_ else None,
        "chat_ttft_mean_s": round(statistics.mean(i["ttft_s"] for i in chats_), 3) if chats_ else None,
        "chat_ttft_max_s": round(max(i["ttft_s"] for i in chats_), 3) if chats_ else None,
        "detail": items,
    }


def prompts(url: str, n: int, tokens: int, offset: int) -> list[tuple[str, str]]:
    """n needle prompts of about `tokens` tokens, prose and code alternating, depths 10-90%."""
    depths = (0.1, 0.3, 0.5, 0.7, 0.9)
    with httpx.Client(timeout=60) as client:
        return [fit_prompt(client, url, tokens, ("prose", "code")[i % 2], depths[i % len(depths)], offset + i)[:2]
                for i in range(n)]


def run(args: argparse.Namespace) -> dict:
    common = ["--n_ctx", str(args.tokens + 1024), "--verbose", "false", "--pflash_keep_ratio", str(args.keep)]
    servers = {arm: ServerProcess(arm, common + flags) for arm, flags in ARMS.items()}
    results: dict = {"machine": machine(), "tokens": args.tokens, "keep": args.keep, "workloads": {}}
    try:
        for server in servers.values():
            server.start()
        url = servers["concurrent-full"].url
        workloads = {
            "qa8": (prompts(url, 8, args.tokens, 100), [], 4),
            "mix8": (prompts(url, 4, args.tokens, 200), CHATS, 8),
            "qa8x8": (prompts(url, 8, args.tokens, 300), [], 8),
        }
        idle = {arm: asyncio.run(run_workload(s.url, [], CHATS[:1], 1))["chat_ttft_mean_s"] for arm, s in servers.items()}
        results["idle_chat_ttft_s"] = idle
        for name, (longs, chats, in_flight) in workloads.items():
            results["workloads"][name] = {}
            for arm, server in servers.items():
                outcome = asyncio.run(run_workload(server.url, longs, chats, in_flight))
                results["workloads"][name][arm] = outcome
                print(name, arm, {k: v for k, v in outcome.items() if k != "detail"}, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return results


def write_docs(results: dict, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, arms = list(results["workloads"]), list(ARMS)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, arm in enumerate(arms):
        ax.bar([x + i * width for x in range(len(names))], [results["workloads"][n][arm]["wall_s"] for n in names], width, label=arm)
    ax.set_xticks([x + width for x in range(len(names))], names)
    ax.set_ylabel("wall time (s)"), ax.set_title("Concurrent PFlash: wall time per workload (lower is better)"), ax.legend()
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "concurrent.png", dpi=110)
    lines = ["# PFlash under concurrent serving (demo model)", "",
             "| workload | arm | wall (s) | mean TTFT, long (s) | chat TTFT mean / max (s) | answers correct |",
             "|---|---|---:|---:|---:|---:|"]
    for name in names:
        for arm in arms:
            w = results["workloads"][name][arm]
            chat = f"{w['chat_ttft_mean_s']} / {w['chat_ttft_max_s']}" if w["chat_ttft_mean_s"] is not None else "-"
            lines.append(f"| {name} | {arm} | {w['wall_s']} | {w['mean_ttft_s']} | {chat} | {w['ok']}/{w['items']} |")
    qa = results["workloads"]["qa8"]
    mix = results["workloads"]["mix8"]["concurrent-pflash"]
    idle = results["idle_chat_ttft_s"]["concurrent-pflash"]
    m = results["machine"]
    lines += ["", f"- qa8: concurrent PFlash is **{qa['concurrent-full']['wall_s'] / qa['concurrent-pflash']['wall_s']:.2f}x** faster in wall time than concurrent full prefill (target >= 2x).",
              f"- mix8: short-chat TTFT beside the long prompts, concurrent PFlash: mean {mix['chat_ttft_mean_s']} s, max {mix['chat_ttft_max_s']} s; idle server {idle} s: **{mix['chat_ttft_mean_s'] / idle:.1f}x** idle (target <= 3x).",
              "", "![wall time per workload](concurrent.png)", "",
              f"Long prompts: ~{results['tokens']} tokens of prose or code with a 4-digit code at 10-90% depth; keep ratio {results['keep']}. "
              f"Machine: {m['nproc']} cores, {m['cpu']}, load at start {m['load_at_start']}.", "", f"Command: `{command}`"]
    (REPO / "docs" / "concurrent.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "concurrent.json")
    args = parser.parse_args()
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    write_docs(results, f"python bench/pflash_concurrent.py --tokens {args.tokens} --keep {args.keep}")


if __name__ == "__main__":
    main()

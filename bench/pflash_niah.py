"""PFlash on the demo model: needle-in-a-haystack retrieval and TTFT, full prefill vs compressed.

Two servers on the demo model, one with PFlash off and one with PFlash on (the target stopped at
its first global layer as drafter), each prompt sent to both in turn (A, B interleaved; separate
servers so neither's prefix cache helps the other). Per prompt: retrieval (the 4-digit code in
the answer), server-side TTFT, the drafter cost share c = draft_ms / full-prefill TTFT, the kept
ratio r, the speedup and its bound 1 / (r + c).

Usage: python bench/pflash_niah.py [--lengths 4096 8192 16384] [--keep 0.1] [--quick]
Writes bench/results/pflash_niah.json, docs/pflash.md and docs/pflash.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from harness import REPO, ServerProcess, fit_prompt, machine

DEPTHS = (0.1, 0.5, 0.9)
KINDS = ("prose", "code", "multi")


def grid(lengths: list[int], quick: bool) -> list[dict]:
    items = []
    for n_tokens in lengths:
        for kind in KINDS:
            for depth in (DEPTHS if kind != "multi" else (0.5,)):
                if quick and (kind != "prose" or depth != 0.5):
                    continue
                items.append({"tokens": n_tokens, "kind": kind, "depth": depth})
    return items


def ask(client: httpx.Client, url: str, prompt: str) -> dict:
    t0 = time.perf_counter()
    reply = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    reply["wall_s"] = time.perf_counter() - t0
    return reply


def run(args: argparse.Namespace) -> dict:
    common = ["--n_ctx", str(max(args.lengths) + 512), "--max_concurrency", "1", "--verbose", "false"]
    full = ServerProcess("niah-full", common + ["--pflash", "off"]).start()
    pflash = ServerProcess("niah-pflash", common + ["--pflash", "always", "--pflash_keep_ratio", str(args.keep)]).start()
    rows = []
    try:
        with httpx.Client(timeout=1800) as client:
            for seed, item in enumerate(grid(args.lengths, args.quick)):
                prompt, code, count = fit_prompt(client, full.url, item["tokens"], item["kind"], item["depth"], seed)
                a = ask(client, full.url, prompt)
                b = ask(client, pflash.url, prompt)
                report = b["usage"]["timings"]["pflash"]
                ttft_full, ttft_pflash = a["usage"]["timings"]["ttft_ms"], b["usage"]["timings"]["ttft_ms"]
                c = report.get("draft_ms", 0.0) / ttft_full
                r = report["kept_tokens"] / report["original_tokens"]
                row = {**item, "prompt_tokens": count, "code": code,
                       "full_ok": code in a["choices"][0]["text"], "pflash_ok": code in b["choices"][0]["text"],
                       "full_ttft_ms": ttft_full, "pflash_ttft_ms": ttft_pflash, "draft_ms": report.get("draft_ms"),
                       "status": report["status"], "r": round(r, 4), "c": round(c, 4),
                       "speedup": round(ttft_full / ttft_pflash, 3), "bound": round(1 / (r + c), 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        full.stop()
        pflash.stop()
    return {"rows": rows, "machine": machine(), "keep_ratio": args.keep}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        group = [r for r in rows if r["tokens"] == n]
        speedup = statistics.median(r["speedup"] for r in group)
        bound = statistics.median(r["bound"] for r in group)
        out.append({
            "tokens": n, "prompts": len(group),
            "full_retrieved": sum(r["full_ok"] for r in group), "pflash_retrieved": sum(r["pflash_ok"] for r in group),
            "full_ttft_s": round(statistics.median(r["full_ttft_ms"] for r in group) / 1000, 2),
            "pflash_ttft_s": round(statistics.median(r["pflash_ttft_ms"] for r in group) / 1000, 2),
            "r": statistics.median(r["r"] for r in group), "c": round(statistics.median(r["c"] for r in group), 3),
            "speedup": round(speedup, 2), "bound": round(bound, 2), "of_bound": round(speedup / bound, 2),
        })
    return out


def write_docs(result: dict, summary: list[dict], command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = REPO / "docs"
    docs.mkdir(exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = [s["tokens"] for s in summary]
    left.plot(x, [s["full_ttft_s"] for s in summary], "o-", label="full prefill")
    left.plot(x, [s["pflash_ttft_s"] for s in summary], "o-", label=f"PFlash (keep {result['keep_ratio']})")
    left.set_xlabel("prompt tokens"), left.set_ylabel("median TTFT (s)"), left.legend(), left.set_title("TTFT")
    right.plot(x, [s["speedup"] for s in summary], "o-", label="measured speedup")
    right.plot(x, [s["bound"] for s in summary], "s--", label="bound 1/(r+c)")
    right.set_xlabel("prompt tokens"), right.set_ylabel("x faster"), right.legend(), right.set_title("Speedup")
    fig.tight_layout()
    fig.savefig(docs / "pflash.png", dpi=110)
    lines = [
        "# PFlash on the demo model: needle in a haystack", "",
        "| prompt tokens | prompts | retrieved, full | retrieved, PFlash | TTFT full (s) | TTFT PFlash (s) | r | c | speedup | bound 1/(r+c) | of bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(f"| {s['tokens']} | {s['prompts']} | {s['full_retrieved']}/{s['prompts']} | {s['pflash_retrieved']}/{s['prompts']} | "
                     f"{s['full_ttft_s']} | {s['pflash_ttft_s']} | {s['r']} | {s['c']} | {s['speedup']}x | {s['bound']}x | {s['of_bound']:.0%} |")
    m = result["machine"]
    lines += ["", "![PFlash TTFT and speedup](pflash.png)", "",
              f"Medians per length over haystacks of prose, code and prose with three needles (two distractors), "
              f"needles at 10/50/90% depth. r = kept / prompt tokens, c = drafter scoring time / full-prefill TTFT. "
              f"Machine: {m['nproc']} cores, {m['cpu']}, load at start {m['load_at_start']}.", "",
              f"Command: `{command}`", "", "## Every prompt", "",
              "| tokens | kind | depth | full ok | PFlash ok | full TTFT ms | PFlash TTFT ms | r | c | speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['prompt_tokens']} | {r['kind']} | {r['depth']} | {r['full_ok']} | {r['pflash_ok']} | {r['full_ttft_ms']:.0f} | {r['pflash_ttft_ms']:.0f} | {r['r']} | {r['c']} | {r['speedup']} |")
    (docs / "pflash.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="one prose prompt per length, no docs")
    parser.add_argument("--no_docs", action="store_true", help="keep docs/pflash.md (a rerun of some lengths)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pflash_niah.json")
    args = parser.parse_args()
    result = run(args)
    summary = summarize(result["rows"])
    result["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for s in summary:
        print(json.dumps(s))
    if not (args.quick or args.no_docs):
        write_docs(result, summary, "python bench/pflash_niah.py " + " ".join(f"--lengths {' '.join(map(str, args.lengths))} --keep {args.keep}".split()))


if __name__ == "__main__":
    main()

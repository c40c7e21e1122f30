"""docs/multi_gpu.md and docs/multi_gpu.png from the two-GPU runs in docs/data/multi_gpu_h200x2.json.

    python bench/gpu/multi_gpu_report.py

The input holds what `bash bench/gpu/multi_gpu.sh --out $OUT/multi_gpu.json` (bench/gpu/multi_gpu.py)
wrote on a machine with two H200s, arm by arm; its `runs` say which command gave which arm.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs"
DATA = DOCS / "data" / "multi_gpu_h200x2.json"
SPLITS = {"none": "one GPU", "layer": "by layers (`--split_mode 1`)", "row": "by rows (`--split_mode 2`)"}
SERVING_TARGET = 1.5  # ours / llama-server at 64 clients, same split
REPLICA_TARGET = 1.8  # two replicas / one, 64 clients each
METHOD = """\
- Models: random-weight GGUFs of real shapes (`pflash_plugin.testing.write_tiny_llama`, tiled): the
  target 8B-class F16 (32 layers, width 4,096, GQA 32/8), the drafter 0.6B-class F16 (28 layers,
  width 1,024). Timing does not depend on the weights.
- Servers: 64 slots, a KV pool of 131,072 cells (llama-server: `-c 131072 -np 64 -kvu`, unified
  KV), flash attention, n_batch 2,048, n_ubatch 512, every layer on the GPUs, the same split.
  Ours also runs PFlash: `--pflash auto --pflash_drafter` the 0.6B model (on main_gpu), keep 0.1,
  threshold 16,384, start-up calibration on.
- Per split, the servers are loaded at once and driven one at a time over HTTP (`/v1/completions`,
  token-id prompts), reps interleaved ours, llama-server, ours, ...; each figure is the median
  over reps.
- Throughput: C clients each send 2 requests (32-token prompt, 128 tokens, temperature 0;
  llama-server with `ignore_eos`) one after the other; completion tokens from `usage` over the wall
  time. The random target ends some of ours' requests early with EOS (column "short"): tokens/s
  counts the tokens generated.
- Short TTFT: 4 streamed 32-token requests sent together, idle and 0.5 s after a streamed 32K-token
  prompt was sent; ours prefills that prompt in full (per-request `pflash: {"mode": "off"}`).
- 64K prompt: time to the answer of one non-streamed 65,536-token request with `max_tokens` 1.
- Replicas: ours twice, one per GPU; 64 clients on the first alone, then 64 on each at once,
  interleaved. `replicas` gives each process its GPU with `CUDA_VISIBLE_DEVICES`; the
  `replicas-main-gpu` arms start both with both GPUs visible and `--split_mode 0 --main_gpu i`."""


def median(rows: list[dict[str, Any]], key: str, **match: Any) -> float | None:
    values = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items()) and r.get(key) is not None]
    return statistics.median(values) if values else None


def errors(rows: list[dict[str, Any]]) -> list[str]:
    return [r["error"] for r in rows if r["kind"] == "error"]


def serving_rows(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per split and server: medians of tokens/s, TTFTs and long-prompt times."""
    out = []
    for split, rows in results.items():
        if split not in SPLITS:
            continue
        for server in dict.fromkeys(r["server"] for r in rows if r["kind"] == "start"):
            throughput = [r for r in rows if r["kind"] == "throughput" and r["server"] == server]
            out.append({
                "split": split, "server": server, "ours": server.startswith("ours"),
                "tok_s_16": median(throughput, "tok_s", clients=16),
                "tok_s_64": median(throughput, "tok_s", clients=64),
                "short": sum(r["short_requests"] for r in throughput),
                "requests": sum(2 * r["clients"] for r in throughput),
                "idle_s": median(rows, "idle_s", server=server, kind="ttft"),
                "beside_s": median(rows, "beside_s", server=server, kind="ttft"),
                "prefill_s": median(rows, "long_ttft_s", server=server, kind="ttft"),
                "full_s": median(rows, "full_s", server=server, kind="long"),
                "pflash_s": median(rows, "pflash_s", server=server, kind="long"),
                "calibration": next((r.get("pflash_calibration") for r in rows if r["server"] == server and r["kind"] == "start"), None),
            })
    return out


def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{unit}"


def peer_of(row: dict[str, Any], rows: list[dict[str, Any]], variant: str = "") -> dict[str, Any] | None:
    """llama-server in the same split: with its defaults, or a variant (`-cache-ram-0`)."""
    name = f"llama-server-{row['split']}{variant}"
    return next((r for r in rows if r["split"] == row["split"] and r["server"] == name), None)


PEERS = {"": "its defaults", "-cache-ram-0": "`--cache-ram 0`"}


def ratio_to_peers(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Ours' 64-client throughput over each llama-server's, with the target's verdict on a split."""
    parts = []
    for variant, label in PEERS.items():
        peer = peer_of(row, rows, variant)
        if peer and row["tok_s_64"] and peer["tok_s_64"]:
            value = row["tok_s_64"] / peer["tok_s_64"]
            verdict = "" if row["split"] == "none" else f", target {SERVING_TARGET}x {'met' if value >= SERVING_TARGET else 'missed'}"
            parts.append(f"**{value:.2f}x** vs {label}{verdict}")
    return "; ".join(parts)


def serving_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| split | server | tok/s, 16 clients | tok/s, 64 clients | ours / llama-server, 64 clients | short "
             "| short TTFT, idle | short TTFT beside a 32K prefill | the 32K prompt's TTFT |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        ratio = ratio_to_peers(row, rows) if row["ours"] else ""
        lines.append(f"| {SPLITS[row['split']]} | {row['server']} | {fmt(row['tok_s_16'], ',.0f')} "
                     f"| {fmt(row['tok_s_64'], ',.0f')} | {ratio} | {row['short']}/{row['requests']} "
                     f"| {fmt(row['idle_s'], '.3f', ' s')} | {fmt(row['beside_s'], '.3f', ' s')} "
                     f"| {fmt(row['prefill_s'], '.2f', ' s')} |")
    return "\n".join(lines)


def long_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| split | llama-server, full prefill (defaults / `--cache-ram 0`) | ours, full prefill "
             "| ours, PFlash (keep 0.1) | PFlash against llama-server's faster | ours' start-up calibration at 32K "
             "(full / PFlash) |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        peers = [p for p in (peer_of(row, rows, v) for v in PEERS) if p and p["full_s"]]
        if not row["ours"] or not peers:
            continue
        best = min(p["full_s"] for p in peers)
        speedup = best / row["pflash_s"] if row["pflash_s"] else None
        cal = row["calibration"]
        calibration = f"{cal['full_s']:.2f} s / {cal['pflash_s']:.2f} s ({cal['speedup']:.1f}x)" if cal else ""
        full = " / ".join(fmt(p["full_s"], ".2f", " s") for p in peers)
        lines.append(f"| {SPLITS[row['split']]} | {full} | {fmt(row['full_s'], '.2f', ' s')} "
                     f"| {fmt(row['pflash_s'], '.2f', ' s')} | **{fmt(speedup, '.1f', 'x')}** | {calibration} |")
    return "\n".join(lines)


def replica_rows(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for arm, rows in results.items():
        if not arm.startswith("replicas"):
            continue
        throughput = [r for r in rows if r["kind"] == "throughput"]
        one = median([r for r in throughput if r["servers"] == 1], "tok_s")
        two = median([r for r in throughput if r["servers"] == 2], "tok_s")
        out.append({"arm": arm, "one": one, "two": two, "errors": errors(rows),
                    "reps": len([r for r in throughput if r["servers"] == 1])})
    return out


def replica_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| arm | one replica, 64 clients (tok/s) | two replicas, 64 clients each (tok/s) | two / one |",
             "|---|---:|---:|---:|"]
    for row in rows:
        if row["two"] and row["one"]:
            ratio = row["two"] / row["one"]
            two = f"{row['two']:,.0f}"
            verdict = f"**{ratio:.2f}x** (target {REPLICA_TARGET}x: {'met' if ratio >= REPLICA_TARGET else 'missed'})"
        else:
            two, verdict = "hung (below)", "not measured"
        lines.append(f"| `{row['arm']}` | {fmt(row['one'], ',.0f')} | {two} | {verdict} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["tok_s_64"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, title in ((axes[0], "tok_s_16", "16 clients"), (axes[1], "tok_s_64", "64 clients")):
        labels = [f"{r['server']}" for r in measured]
        ax.barh(labels, [r[key] or 0 for r in measured], color=["#08519c" if r["ours"] else "#bdbdbd" for r in measured])
        ax.set_xlabel("generated tokens/s")
        ax.set_title(f"{title} x 2 requests x 128 tokens")
        ax.invert_yaxis()
    fig.suptitle("Two H200s, 8B-class F16 model on one GPU and split by layers: ours (blue) and llama-server")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    data = json.loads(DATA.read_text())
    results, machine = data["results"], data["machine"]

    def notes(section: str) -> list[str]:
        """What the run's notes (kept with its data) say under a section."""
        return [f"- {note}" for note in data.get("notes", {}).get(section, [])]

    rows = serving_rows(results)
    plot(rows, DOCS / "multi_gpu.png")
    failed = {split: errors(r) for split, r in results.items() if split in SPLITS and errors(r)}
    replicas = replica_rows(results)
    parts = [
        "# Two GPUs: one model split across both, and two replicas",
        "",
        "Generated by `python bench/gpu/multi_gpu_report.py` from `docs/data/multi_gpu_h200x2.json`, written on a "
        "machine with two H200s by `bash bench/gpu/multi_gpu.sh --out $OUT/multi_gpu.json` (the runs are listed "
        "at the end).",
        "",
        "![two GPUs](multi_gpu.png)",
        "",
        "## Serving: ours against llama-server on one GPU and with the same split",
        "",
        serving_table(rows),
        "",
        *notes("serving"),
        "",
        "## A 64K-token prompt: time to the first token",
        "",
        long_table(rows),
        "",
        *notes("long"),
        "",
    ]
    for split, messages in failed.items():
        parts += [f"## Split {SPLITS[split]}: not measured", "", *[f"- {m}" for m in messages], "", *notes("row"), ""]
    if replicas:
        parts += ["## Two replicas, one per GPU", "", replica_table(replicas), "",
                  *[f"- `{r['arm']}`: {e}" for r in replicas for e in r["errors"]], "", *notes("replicas"), ""]
    parts += ["## Method", "", METHOD, "", "## Machine and runs", "",
              f"- GPUs: {'; '.join(machine['gpus'])}; {machine['cpus']} CPU cores",
              *[f"- {run}" for run in data.get("runs", [])], "- GPU links (`nvidia-smi topo -m`):", "",
              "```", machine["topology"], "```", ""]
    (DOCS / "multi_gpu.md").write_text("\n".join(parts))
    print((DOCS / "multi_gpu.md").read_text())


if __name__ == "__main__":
    main()

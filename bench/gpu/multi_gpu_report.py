"""docs/multi_gpu.md and docs/multi_gpu.png from the two-GPU run in docs/data/multi_gpu.json.

    python bench/gpu/multi_gpu_report.py

The input is written on a machine with two GPUs by
`bash bench/gpu/multi_gpu.sh --out $OUT/multi_gpu.json` (see bench/gpu/multi_gpu.py).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs"
DATA = DOCS / "data" / "multi_gpu.json"
SPLITS = {"none": "one GPU", "layer": "by layers (`--split_mode 1`)", "row": "by rows (`--split_mode 2`)"}
SERVING_TARGET = 1.5  # ours / llama-server at 64 clients, same split
REPLICA_TARGET = 1.8  # two replicas / one, 64 clients each
METHOD = """\
- Models: random-weight GGUFs of real shapes (`pflash_plugin.testing.write_tiny_llama`, tiled): the
  target 8B-class F16 (32 layers, width 4,096, GQA 32/8), the drafter 0.6B-class F16 (28 layers,
  width 1,024). Timing does not depend on the weights.
- Both servers: 64 slots, a KV pool of 131,072 cells (llama-server: `-c 131072 -np 64 -kvu`,
  unified KV), flash attention, n_batch 2,048, n_ubatch 512, every layer on the GPUs, the same
  `--split_mode`/`-sm`. Ours also runs PFlash (`--pflash auto --pflash_drafter` the 0.6B model
  on main_gpu, keep 0.1, threshold 16,384, start-up calibration on).
- Per split, both servers are loaded at once and driven one at a time over HTTP
  (`/v1/completions`, token-id prompts), reps interleaved ours, llama-server, ours, ...; each
  figure is the median over reps.
- Throughput: C clients each send 2 requests (32-token prompt, 128 tokens, temperature 0; llama-server
  with `ignore_eos`) one after the other; completion tokens from `usage` over the wall time.
- Short TTFT: 4 streamed 32-token requests sent together, idle and 0.5 s after a streamed 32K-token
  prompt was sent; ours prefills that prompt in full (per-request `pflash: {"mode": "off"}`).
- 64K prompt: time to the answer of one non-streamed 65,536-token request with `max_tokens` 1.
- Replicas: ours twice, `--split_mode 0 --main_gpu 0` and `--main_gpu 1`; 64 clients on the first
  alone, then 64 on each at once, interleaved.\
"""


def median(rows: list[dict[str, Any]], key: str, **match: Any) -> float | None:
    values = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items()) and r.get(key) is not None]
    return statistics.median(values) if values else None


def servers(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["server"] for r in rows if r["kind"] == "start"))


def serving_rows(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per split and server: medians of tokens/s, TTFTs and long-prompt times."""
    out = []
    for split, rows in results.items():
        if split not in SPLITS:
            continue
        for server in servers(rows):
            out.append({
                "split": split, "server": server, "ours": server.startswith("ours"),
                "tok_s_16": median(rows, "tok_s", server=server, kind="throughput", clients=16),
                "tok_s_64": median(rows, "tok_s", server=server, kind="throughput", clients=64),
                "idle_s": median(rows, "idle_s", server=server, kind="ttft"),
                "beside_s": median(rows, "beside_s", server=server, kind="ttft"),
                "prefill_s": median(rows, "long_ttft_s", server=server, kind="ttft"),
                "full_s": median(rows, "full_s", server=server, kind="long"),
                "pflash_s": median(rows, "pflash_s", server=server, kind="long"),
            })
    return out


def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{unit}"


def serving_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| split | server | tok/s, 16 clients | tok/s, 64 clients | ours / llama-server, 64 | "
             "short TTFT, idle | short TTFT beside a 32K prefill | the 32K prompt's TTFT |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        peer = next((r for r in rows if r["split"] == row["split"] and not r["ours"]), None)
        ratio = ""
        if row["ours"] and peer and row["tok_s_64"] and peer["tok_s_64"]:
            value = row["tok_s_64"] / peer["tok_s_64"]
            ratio = f"**{value:.2f}x** ({'met' if value >= SERVING_TARGET else 'missed'})" if row["split"] != "none" else f"{value:.2f}x"
        lines.append(f"| {SPLITS[row['split']]} | {row['server']} | {fmt(row['tok_s_16'], ',.0f')} | {fmt(row['tok_s_64'], ',.0f')} "
                     f"| {ratio} | {fmt(row['idle_s'], '.3f', ' s')} | {fmt(row['beside_s'], '.3f', ' s')} "
                     f"| {fmt(row['prefill_s'], '.2f', ' s')} |")
    return "\n".join(lines)


def long_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| split | llama-server, full prefill | ours, full prefill | ours, PFlash (keep 0.1) | PFlash / llama-server |",
             "|---|---:|---:|---:|---:|"]
    for split in dict.fromkeys(r["split"] for r in rows):
        ours = next((r for r in rows if r["split"] == split and r["ours"]), None)
        peer = next((r for r in rows if r["split"] == split and not r["ours"]), None)
        if not ours or not peer:
            continue
        speedup = peer["full_s"] / ours["pflash_s"] if peer["full_s"] and ours["pflash_s"] else None
        lines.append(f"| {SPLITS[split]} | {fmt(peer['full_s'], '.2f', ' s')} | {fmt(ours['full_s'], '.2f', ' s')} "
                     f"| {fmt(ours['pflash_s'], '.2f', ' s')} | **{fmt(speedup, '.1f', 'x')}** |")
    return "\n".join(lines)


def replica_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    one = median([r for r in rows if r["kind"] == "throughput" and r["servers"] == 1], "tok_s")
    two = median([r for r in rows if r["kind"] == "throughput" and r["servers"] == 2], "tok_s")
    assert one and two, "the replicas arm has no throughput rows"
    return {"one": one, "two": two, "ratio": two / one, "reps": sum(r["kind"] == "throughput" for r in rows) // 2}


def replica_table(summary: dict[str, Any]) -> str:
    verdict = "met" if summary["ratio"] >= REPLICA_TARGET else "missed"
    return "\n".join([
        "| replicas | clients | tok/s | two / one |", "|---|---:|---:|---:|",
        f"| one (GPU 0) | 64 | {summary['one']:,.0f} | |",
        f"| two (GPU 0 and GPU 1) | 64 each | {summary['two']:,.0f} | **{summary['ratio']:.2f}x** "
        f"(target {REPLICA_TARGET}x, {verdict}) |",
    ])


def plot(rows: list[dict[str, Any]], replicas: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ours, peer = [], [], []
    for split in dict.fromkeys(r["split"] for r in rows):
        labels.append(split)
        ours.append(next((r["tok_s_64"] or 0 for r in rows if r["split"] == split and r["ours"]), 0))
        peer.append(next((r["tok_s_64"] or 0 for r in rows if r["split"] == split and not r["ours"]), 0))
    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(len(labels)))
    ax.bar([i - 0.2 for i in x], ours, 0.4, label="pflash_plugin")
    ax.bar([i + 0.2 for i in x], peer, 0.4, label="llama-server")
    if replicas:
        x.append(len(labels))
        labels.append("2 replicas")
        ax.bar([len(labels) - 1.2], [replicas["one"]], 0.4, color="#9ecae1", label="pflash_plugin, one replica")
        ax.bar([len(labels) - 0.8], [replicas["two"]], 0.4, color="#08519c", label="pflash_plugin, two replicas")
    ax.set_xticks(x, [f"split {label}" if label in SPLITS else label for label in labels])
    ax.set_ylabel("generated tokens/s, 64 clients (each)")
    ax.set_title("Two H200s: 8B-class F16 model, 64 clients x 2 requests x 128 tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    data = json.loads(DATA.read_text())
    results = data["results"]
    rows = serving_rows(results)
    replicas = replica_summary(results["replicas"]) if "replicas" in results else None
    plot(rows, replicas, DOCS / "multi_gpu.png")
    parts = [
        "# Two GPUs: one model split across both, and two replicas",
        "",
        "Generated by `python bench/gpu/multi_gpu_report.py` from `docs/data/multi_gpu.json`, which "
        "`bash bench/gpu/multi_gpu.sh --out $OUT/multi_gpu.json` wrote on a machine with two H200s "
        "(see the method below).",
        "",
        "![two GPUs](multi_gpu.png)",
        "",
        "## Serving: ours against llama-server with the same split",
        "",
        serving_table(rows),
        "",
        f"Target: a model split across both GPUs serves 64 clients at {SERVING_TARGET}x or more of "
        "llama-server with the same split.",
        "",
        "## A 64K-token prompt: time to the first token",
        "",
        long_table(rows),
        "",
    ]
    if replicas:
        parts += ["## Two replicas, one per GPU", "", replica_table(replicas), ""]
    machine = data["machine"]
    parts += ["## Method", "", METHOD, "", "## Machine", "",
              f"- GPUs: {'; '.join(machine['gpus'])}; {machine['cpus']} CPU cores",
              f"- command: `{' '.join(machine['argv'])}`", "- GPU links (`nvidia-smi topo -m`):", "",
              "```", machine["topology"], "```", ""]
    (DOCS / "multi_gpu.md").write_text("\n".join(parts))
    print((DOCS / "multi_gpu.md").read_text())


if __name__ == "__main__":
    main()

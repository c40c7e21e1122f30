"""docs/upstream_gpu.md and its plot: ours against llama-cpp-python's own example server
(bench/upstream.py) on the H200, from bench/gpu/queues/upstream.txt's results in docs/data.

    python bench/gpu/upstream_report.py [--out-dir docs] [--no-plot]

Decode (bench/gpu/decode_scale.py): tok/s medians over reps per mode and clients, a run over the
bench's time limit shown as such. Seed workloads (bench/gpu/concurrent_gpu.py --groups upstream):
medians over the reps each arm has. The page's text below `<!-- notes -->` is kept.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrent_report import load, medians  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
DECODE = DOCS / "data" / "decode_scale_upstream_h200.json"
WORKLOADS = [DOCS / "data" / name for name in ("concurrent_upstream_h200.json", "concurrent_upstream_r12_h200.json",
                                               "concurrent_upstream_cd4_h200.json")]
SERVERS = [("ours-host-sampling", "ours"), ("llama-server-bs", "llama-server -bs"), ("upstream", "upstream example")]
ARMS = [("full", "ours, full prefill"), ("pflash", "ours, PFlash"), ("upstream", "upstream example, full prefill")]
NAMES = {"qa8": "qa8: 8 x 22K tokens, 16 out", "mix8": "mix8: 4 x 22K + 4 short, 32 out",
         "cd4": "cd4: 4 x 84K tokens, 1,024 out"}
NOTES = "<!-- notes -->"


Decode = dict[tuple[str, int, str], "float | str"]  # (mode, clients, server): median tok/s, or why none


def decode_cells(path: Path) -> tuple[Decode, dict[str, Any]]:
    """Per (mode, clients, server): the median tok/s over reps, or the limit it ran over."""
    data = json.loads(path.read_text())
    rows = [r for r in data["results"]["servers"] if r.get("kind") == "throughput"]
    cells: Decode = {}
    for key in dict.fromkeys((r["mode"], r["clients"], r["server"]) for r in rows):
        reps = [r for r in rows if (r["mode"], r["clients"], r["server"]) == key]
        done = [r["tok_s"] for r in reps if "tok_s" in r]
        cells[key] = float(statistics.median(done)) if len(done) == len(reps) else \
            f"over the limit in {len(reps) - len(done)} of {len(reps)}"
    return cells, data["machine"]


def decode_table(cells: Decode) -> list[str]:
    lines = ["| mode | clients | " + " | ".join(name for _, name in SERVERS) + " | ours / upstream |",
             "|---|---|" + "---|" * (len(SERVERS) + 1)]
    for mode, clients in dict.fromkeys((m, c) for m, c, _ in cells):
        row = [cells.get((mode, clients, server), "-") for server, _ in SERVERS]
        ours, peer = row[0], row[-1]
        gain = f"{ours / peer:.2f}x" if isinstance(ours, float) and isinstance(peer, float) else "-"
        shown = [f"{c:,.0f}" if isinstance(c, float) else c for c in row]
        lines.append(f"| {mode} | {clients} | " + " | ".join(shown) + f" | **{gain}** |")
    return lines


def workload_table(cells: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    lines = ["| workload | measure | " + " | ".join(name for _, name in ARMS) + " | upstream / ours full |",
             "|---|---|" + "---|" * (len(ARMS) + 1)]
    measures = [("wall_s", "wall (s)"), ("ttft_mean_s", "long prompts' mean TTFT (s)"),
                ("short_ttft_mean_s", "short requests' mean TTFT (s)")]
    for workload in NAMES:
        for key, label in measures:
            values = [cells.get((arm, workload), {}).get(key) for arm, _ in ARMS]
            if values[0] is None:
                continue
            reps = "/".join(str(cells.get((arm, workload), {}).get("reps", 0)) for arm, _ in ARMS)
            shown = ["-" if v is None else f"{v:.3f}" if v < 1 else f"{v:.2f}" for v in values]
            gain = f"**{values[2] / values[0]:.2f}x**" if values[2] is not None else "-"
            lines.append(f"| {NAMES[workload]} (reps {reps}) | {label} | " + " | ".join(shown) + f" | {gain} |")
    return lines


def plot(cells: Decode, workloads: dict[tuple[str, str], dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    keys = list(dict.fromkeys((m, c) for m, c, _ in cells))
    width = 0.8 / len(SERVERS)
    for i, (server, name) in enumerate(SERVERS):
        values = [cell if isinstance(cell := cells.get((mode, clients, server)), float) else 0.0
                  for mode, clients in keys]
        left.bar([k + i * width for k in range(len(keys))], values, width, label=name)
    left.set_xticks([k + width for k in range(len(keys))], [f"{m}\n{c} cl." for m, c in keys], fontsize=8)
    left.set_ylabel("tok/s (median)")
    left.set_title("decode, 2 x 128 tokens per client (0: over the limit)")
    left.legend(fontsize=8)
    names = [w for w in NAMES if ("full", w) in workloads]
    width = 0.8 / len(ARMS)
    for i, (arm, name) in enumerate(ARMS):
        right.bar([k + i * width for k in range(len(names))],
                  [workloads.get((arm, w), {}).get("wall_s", 0) for w in names], width, label=name)
    right.set_xticks([k + width for k in range(len(names))], names)
    right.set_ylabel("wall time (s, median)")
    right.set_title("seed workloads, every request at once")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def page(decode: list[str], workloads: list[str], machine: dict[str, Any], notes: str) -> str:
    return "\n".join([
        "# Ours against llama-cpp-python's own example server (H200)",
        "",
        "llama-cpp-python 0.3.36 ships a batched server, `examples/server/server.py` in its sdist, over the same",
        "bindings. Here it runs in its best configuration (bench/upstream.py: a sequence per slot, `store_logits`",
        "off, every layer on the GPU with flash attention, n_batch 2048 / n_ubatch 512; for the seed workloads a KV",
        "stream per sequence) beside ours and llama-server `-bs`, all up at once, driven one at a time, reps",
        f"interleaved. One H200, 8B-class F16 target at a 128,341-token vocabulary (random weights), tree {machine.get('tree')}.",
        "",
        "Regenerate: `python bench/gpu/upstream_report.py` (data: docs/data/decode_scale_upstream_h200.json,",
        "concurrent_upstream_*_h200.json; run: bench/gpu/queues/upstream.txt).",
        "",
        "## Decode: C clients x 2 requests x 128 tokens, 64 slots (tok/s, medians of 3)",
        "",
        *decode,
        "",
        "## The seed's workloads, 4 slots (medians over the reps each arm has)",
        "",
        *workloads,
        "",
        "![ours against the upstream example server](upstream_gpu.png)",
        "",
        NOTES,
        notes,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DOCS)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    cells, machine = decode_cells(DECODE)
    rows, _ = load(WORKLOADS)
    workloads = medians(rows)
    target = args.out_dir / "upstream_gpu.md"
    old = target.read_text() if target.exists() else ""
    notes = old.split(NOTES, 1)[1].lstrip("\n") if NOTES in old else ""
    target.write_text(page(decode_table(cells), workload_table(workloads), machine, notes))
    if not args.no_plot:
        plot(cells, workloads, args.out_dir / "upstream_gpu.png")
    print(target.read_text())


if __name__ == "__main__":
    main()

"""docs/concurrent_gpu.md and its plot from bench/gpu/concurrent_gpu.py's results.

    python bench/gpu/concurrent_report.py [--data docs/data/concurrent_gpu_h200.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARMS = [("serial-pflash", "ours, serial PFlash (1 slot)"), ("full", "ours, full prefill"),
        ("pflash", "ours, PFlash"), ("llama-server", "llama-server, full prefill")]
WORKLOADS = [("qa8", "qa8: 8 x 22K tokens, 16 out"), ("mix8", "mix8: 4 x 22K + 4 short, 32 out"),
             ("cd4", "cd4: 4 x 84K tokens, 1,024 out")]
# the same workloads, models and flags on one H200 with one unified KV cache for all slots and
# --prefill_chunk 128 (issue 19's table, a run of an earlier commit; not measured beside these)
UNIFIED_BEFORE = {"qa8": (22.6, 16.6), "mix8": (11.6, 11.2), "cd4": (150.3, 125.6)}


def medians(data: dict) -> dict[tuple[str, str], dict[str, float]]:
    rows: dict[tuple[str, str], list[dict]] = {}
    for group in data["results"].values():
        for row in group:
            if "workload" in row:
                rows.setdefault((row["arm"], row["workload"]), []).append(row)
    keys = ("wall_s", "ttft_mean_s", "short_ttft_mean_s")
    return {k: {key: statistics.median(r[key] for r in v) for key in keys if key in v[0]} | {"reps": len(v)}
            for k, v in rows.items()}


def cell(m: dict, workload: str) -> str:
    if not m:
        return "-"
    second = m.get("short_ttft_mean_s") if workload == "mix8" else m["ttft_mean_s"]
    return f"{m['wall_s']:.2f} s / {second:.3f} s" if workload == "mix8" else f"{m['wall_s']:.2f} s / {second:.2f} s"


def table(result: dict) -> list[str]:
    lines = ["| workload (wall / mean TTFT; mix8: wall / short TTFT) | " + " | ".join(label for _, label in ARMS)
             + " | ours full, unified KV (before) |", "|---" * (len(ARMS) + 2) + "|"]
    for workload, label in WORKLOADS:
        before = UNIFIED_BEFORE[workload]
        lines.append(f"| {label} | " + " | ".join(cell(result.get((arm, workload), {}), workload) for arm, _ in ARMS)
                     + f" | {before[0]:.1f} s / {before[1]:.1f} s |")
    return lines


def ratios(result: dict) -> list[str]:
    out = []
    for workload, _ in WORKLOADS:
        full, peer = result.get(("full", workload)), result.get(("llama-server", workload))
        pflash, serial = result.get(("pflash", workload)), result.get(("serial-pflash", workload))
        if not (full and peer and pflash and serial):
            continue
        out.append(f"| {workload} | {full['wall_s'] / peer['wall_s']:.2f}x | "
                   f"{full['ttft_mean_s'] / peer['ttft_mean_s']:.2f}x | {peer['wall_s'] / pflash['wall_s']:.1f}x | "
                   f"{pflash['wall_s'] / serial['wall_s']:.2f}x |")
    return ["| workload | ours full / llama-server, wall | same, mean TTFT | llama-server full / ours PFlash, wall "
            "| ours PFlash / serial PFlash, wall |", "|---|---|---|---|---|", *out]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(12, 3.6))
    for ax, (workload, label) in zip(axes, WORKLOADS):
        walls = [result.get((arm, workload), {}).get("wall_s", 0) for arm, _ in ARMS]
        ax.bar(range(len(ARMS)), walls, color=["#8da0cb", "#fc8d62", "#66c2a5", "#999999"])
        ax.set_xticks(range(len(ARMS)), [a.replace("ours, ", "").replace(", full prefill", "") for _, a in ARMS],
                      rotation=25, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("wall time (s)")
    fig.suptitle("Every request sent at once, one H200, 8B-class F16 target (lower is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO / "docs" / "data" / "concurrent_gpu_h200.json")
    args = parser.parse_args()
    data = json.loads(args.data.read_text())
    result = medians(data)
    plot(result, REPO / "docs" / "concurrent_gpu.png")
    reps = sorted({m["reps"] for m in result.values()})
    page = REPO / "docs" / "concurrent_gpu.md"
    notes = page.read_text().split("<!-- notes -->", 1)[1] if page.exists() and "<!-- notes -->" in page.read_text() else ""
    page.write_text("\n".join([
        "# Concurrent serving on one GPU: the seed's workloads against llama-server",
        "",
        f"Machine: {', '.join(data['machine']['gpus'])}. Medians of {'/'.join(map(str, reps))} rep(s) per cell.",
        "Regenerate: `bash bench/gpu/servers.sh bench/gpu/concurrent_gpu.py --out $OUT/concurrent_gpu.json` on the "
        "CUDA machine (see bench/gpu/setup.sh), copy the JSON to `docs/data/concurrent_gpu_h200.json`, then "
        "`python bench/gpu/concurrent_report.py`.",
        "",
        "![wall time per workload and arm](concurrent_gpu.png)",
        "",
        *table(result),
        "",
        *ratios(result),
        "",
        "<!-- notes -->" + notes,
    ]))


if __name__ == "__main__":
    main()

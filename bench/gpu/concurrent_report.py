"""docs/concurrent_gpu.md and its plot from bench/gpu/concurrent_gpu.py's results: medians over reps,
and issue 28's targets checked.

    python bench/gpu/concurrent_report.py [--data A.json B.json ...] [--out-dir docs] [--no-plot]

`--data` takes one or more results files (e.g. two device calls, `--first_rep 0` and `--first_rep 2`);
their rows are merged by (arm, workload, rep), a later file's row replacing an earlier one's. TTFT is
the client's (sending to the first chunk with text) unless a column says the server's (`ttft_ms`,
arrival to first token, which ours reports). The page's text below `<!-- notes -->` is kept.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DOCS = Path(__file__).resolve().parents[2] / "docs"
DATA = [DOCS / "data" / name for name in ("concurrent_defaults_r0_h200.json", "concurrent_defaults_r1_h200.json",
                                          "concurrent_defaults_r2_h200.json", "concurrent_defaults_serial_r0_h200.json")]
ARMS = [("full", "ours, full prefill"), ("pflash", "ours, PFlash"), ("llama-server", "llama-server, full prefill"),
        ("serial-pflash", "ours, serial PFlash (1 slot)")]
WORKLOADS = [("qa8", "qa8: 8 x 22K tokens, 16 out"), ("mix8", "mix8: 4 x 22K + 4 short, 32 out"),
             ("cd4", "cd4: 4 x 84K tokens, 1,024 out")]
KEYS = ("wall_s", "ttft_mean_s", "short_ttft_mean_s", "server_ttft_mean_s", "server_short_ttft_mean_s")
PEER_RATIO = 1.05  # ours' full prefill against llama-server's, wall and mean TTFT
Cells = dict[tuple[str, str], dict[str, Any]]  # (arm, workload): medians, "reps" and the per-rep rows


def load(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """The workload rows of every file, merged by (arm, workload, rep); each file's machine and argv."""
    rows: dict[tuple[str, str, int], dict] = {}
    machines = []
    for path in paths:
        data = json.loads(path.read_text())
        machines.append(data.get("machine", {}))
        for group in data["results"].values():
            for row in group:
                if "workload" in row:
                    rows[(row["arm"], row["workload"], row["rep"])] = row
    return list(rows.values()), machines


def medians(rows: list[dict]) -> Cells:
    """Per (arm, workload): the median of each measure over its reps."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["arm"], row["workload"]), []).append(row)
    return {key: {k: statistics.median(r[k] for r in reps) for k in KEYS if all(k in r for r in reps)}
            | {"reps": len(reps), "rows": sorted(reps, key=lambda r: r["rep"])} for key, reps in grouped.items()}


def ttft_key(workload: str, server: bool = False) -> str:
    """The TTFT a workload is judged by: mix8's short requests, else the long prompts' mean."""
    key = "short_ttft_mean_s" if workload == "mix8" else "ttft_mean_s"
    return f"server_{key}" if server else key


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} s" if value < 1 else f"{value:.2f} s"


def cell(cells: Cells, arm: str, workload: str) -> str:
    m = cells.get((arm, workload))
    if not m:
        return "-"
    server = m.get(ttft_key(workload, server=True))
    return (f"{seconds(m['wall_s'])} / {seconds(m[ttft_key(workload)])}"
            + (f" ({seconds(server)})" if server is not None else ""))


def table(cells: Cells) -> list[str]:
    return ["| workload: wall / mean TTFT (mix8: short TTFT), the server's TTFT in brackets | "
            + " | ".join(label for _, label in ARMS) + " |", "|---" * (len(ARMS) + 1) + "|",
            *(f"| {label} | " + " | ".join(cell(cells, arm, workload) for arm, _ in ARMS) + " |"
              for workload, label in WORKLOADS)]


@dataclass(frozen=True)
class Target:
    """One of issue 28's targets: what it asks, the measure (None: not measured) and the bound."""

    name: str
    measure: Callable[[Cells], float | None]
    bound: float
    at_least: bool = False  # the measure must reach the bound, not stay under it
    unit: str = "s"

    def row(self, cells: Cells) -> str:
        value = self.measure(cells)
        if value is None:
            return f"| {self.name} | - | not measured |"
        met = value >= self.bound if self.at_least else value <= self.bound
        shown = f"{value:.3f}x" if self.unit == "x" else seconds(value)
        return f"| {self.name} | {shown} | {'**met**' if met else 'missed'} |"


def median_of(arm: str, workload: str, key: str) -> Callable[[Cells], float | None]:
    return lambda cells: cells.get((arm, workload), {}).get(key)


def ratio(num: Callable[[Cells], float | None], den: Callable[[Cells], float | None]) -> Callable[[Cells], float | None]:
    def measure(cells: Cells) -> float | None:
        a, b = num(cells), den(cells)
        return None if a is None or not b else a / b
    return measure


def targets() -> list[Target]:
    """Issue 28's targets on the medians (PFlash TTFT: the server's, as the issue measured it)."""
    out = [Target("cd4, PFlash: mean TTFT (server's) <= 3 s", median_of("pflash", "cd4", "server_ttft_mean_s"), 3.0),
           Target("cd4, PFlash: llama-server full wall / PFlash wall >= 4x",
                  ratio(median_of("llama-server", "cd4", "wall_s"), median_of("pflash", "cd4", "wall_s")), 4.0,
                  at_least=True, unit="x"),
           Target("qa8, PFlash: wall <= 2.5 s", median_of("pflash", "qa8", "wall_s"), 2.5),
           Target("qa8, PFlash: mean TTFT (server's) <= 1.2 s", median_of("pflash", "qa8", "server_ttft_mean_s"), 1.2),
           Target("mix8, PFlash: short TTFT (server's) <= 0.05 s",
                  median_of("pflash", "mix8", "server_short_ttft_mean_s"), 0.05)]
    for workload, _ in WORKLOADS:
        keys = [("wall", "wall_s"), ("mean TTFT", "ttft_mean_s")]
        if workload == "mix8":
            keys.append(("short TTFT", "short_ttft_mean_s"))
        out += [Target(f"{workload}, full: ours / llama-server, {what} <= {PEER_RATIO}x",
                       ratio(median_of("full", workload, key), median_of("llama-server", workload, key)),
                       PEER_RATIO, unit="x") for what, key in keys]
    return out


def ratios(cells: Cells) -> list[str]:
    out = []
    for workload, _ in WORKLOADS:
        full, peer = cells.get(("full", workload)), cells.get(("llama-server", workload))
        pflash, serial = cells.get(("pflash", workload)), cells.get(("serial-pflash", workload))
        if not (full and peer and pflash and serial):
            continue
        out.append(f"| {workload} | {full['wall_s'] / peer['wall_s']:.2f}x | "
                   f"{full['ttft_mean_s'] / peer['ttft_mean_s']:.2f}x | {peer['wall_s'] / pflash['wall_s']:.1f}x | "
                   f"{pflash['wall_s'] / serial['wall_s']:.2f}x |")
    return ["| workload | ours full / llama-server, wall | same, mean TTFT | llama-server full / ours PFlash, wall "
            "| ours PFlash / serial PFlash, wall |", "|---|---|---|---|---|", *out, ""] if out else []


def per_rep(cells: Cells) -> list[str]:
    """Every rep's row, for the spread behind each median."""
    lines = ["| workload | arm | rep | wall | mean TTFT | short TTFT | server's mean TTFT | server's short TTFT "
             "| compressed | long answers' ms/token |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, _ in WORKLOADS:
        for arm, _ in ARMS:
            for r in cells.get((arm, workload), {}).get("rows", []):
                lines.append(f"| {workload} | {arm} | {r['rep']} | " + " | ".join(seconds(r.get(k)) for k in KEYS)
                             + f" | {r.get('compressed', '-')} | {r.get('itl_mean_ms', '-')} |")
    return lines


def plot(cells: Cells, gpu: str, path: Path) -> None:
    """Per workload, wall (top) and TTFT (bottom) medians as bars, each rep as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(WORKLOADS), figsize=(13, 6.4))
    colors = ["#fc8d62", "#66c2a5", "#999999", "#8da0cb"]
    names = [label.replace("ours, ", "").replace(", full prefill", "") for _, label in ARMS]
    for column, (workload, label) in enumerate(WORKLOADS):
        for ax, key in zip(axes[:, column], ("wall_s", ttft_key(workload))):
            values = [cells.get((arm, workload), {}).get(key, 0) for arm, _ in ARMS]
            ax.bar(range(len(ARMS)), values, color=colors)
            for i, (arm, _) in enumerate(ARMS):
                reps = [r[key] for r in cells.get((arm, workload), {}).get("rows", []) if key in r]
                ax.plot([i] * len(reps), reps, "k.", markersize=4)
            ax.set_xticks(range(len(ARMS)), names, rotation=20, ha="right", fontsize=8)
            ax.set_ylabel({"wall_s": "wall time (s)", "ttft_mean_s": "mean TTFT (s)"}.get(key, "short requests' TTFT (s)"))
            ax.set_title(label, fontsize=9)
    fig.suptitle(f"Every request sent at once, {gpu}, 8B-class F16 target: medians (bars), reps (dots); "
                 "lower is better", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def page(cells: Cells, machines: list[dict], paths: list[Path], notes: str) -> list[str]:
    reps = sorted({m["reps"] for (arm, _), m in cells.items() if arm in dict(ARMS)})
    gpus = sorted({gpu for m in machines for gpu in m.get("gpus", [])}) or ["unknown"]
    commands = [" ".join(m.get("argv", [])) for m in machines]
    return [
        "# Concurrent serving on one GPU: the seed's workloads against llama-server",
        "",
        f"Machine: {', '.join(gpus)}. Medians of {'/'.join(map(str, reps))} rep(s) per cell. "
        f"Data: {', '.join(f'`{p.name}`' for p in paths)} (in `docs/data/`).",
        "Regenerate: on the CUDA machine `NO_LLAMA_SERVER= VOCAB_EXTRA=127000 bash bench/gpu/servers.sh "
        "bench/gpu/concurrent_gpu.py --reps N --first_rep M --out $OUT/concurrent_gpu_M.json`, copy the JSON files to "
        "`docs/data/`, then `python bench/gpu/concurrent_report.py --data docs/data/A.json docs/data/B.json`.",
        "Commands of these data: " + "; ".join(f"`{c}`" for c in commands if c) + ".",
        "",
        "![wall time and TTFT per workload and arm](concurrent_gpu.png)",
        "",
        *table(cells),
        "",
        "Issue 28's targets, on the medians:",
        "",
        "| target | measured | |", "|---|---|---|",
        *(target.row(cells) for target in targets()),
        "",
        *ratios(cells),
        "<details><summary>Every rep</summary>",
        "",
        *per_rep(cells),
        "",
        "</details>",
        "",
        "<!-- notes -->" + notes,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", default=DATA, help="concurrent_gpu.py results files")
    parser.add_argument("--out-dir", dest="out_dir", type=Path, default=DOCS, help="where concurrent_gpu.md and .png go")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="the page only (no matplotlib)")
    args = parser.parse_args(argv)
    rows, machines = load(args.data)
    cells = medians(rows)
    target = args.out_dir / "concurrent_gpu.md"
    old = target.read_text() if target.exists() else ""
    notes = old.split("<!-- notes -->", 1)[1] if "<!-- notes -->" in old else "\n"
    if args.plot:
        gpus = [gpu for m in machines for gpu in m.get("gpus", [])]
        plot(cells, gpus[0].split(",")[0] if gpus else "no GPU", args.out_dir / "concurrent_gpu.png")
    target.write_text("\n".join(page(cells, machines, args.data, notes)))


if __name__ == "__main__":
    main()

"""docs/decode_scale.md and docs/decode_scale.png from bench/gpu/decode_scale.py's results.

    python bench/gpu/decode_scale_report.py

By default it reads the `servers` arm of docs/data/decode_scale_{128,more,confirm}_h200.json (a cell
from the latest tree that measured it: `sourced_cells`), docs/data/decode_engine_overlap{,2}_h200.json (the engine
arm, with and without the overlap of the host's work and the next decode) and, as the earlier run it
compares with (`--before`), docs/data/decode_scale_{overlap,more}_h200.json. `--data` and
`--before` take any results files of decode_scale.py, each side's arms merged; the engine section
shows `--data`'s engine rows, or the earlier run's where `--data` has none. The page's text below
`<!-- notes -->` is kept.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_scale import MODES  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
DATA = [DOCS / "data" / f"{name}_h200.json" for name in ("decode_scale_128", "decode_scale_more", "decode_scale_confirm",
                                                         "decode_engine_overlap", "decode_engine_overlap2", "decode_trace")]
BEFORE = [DOCS / "data" / f"{name}_h200.json" for name in ("decode_scale_overlap", "decode_scale_more")]
BEFORE_LABEL = "the host's work beside the next decode, before slot placement and the sliced grammar pass"
DEVICE, HOST, PEER, PEER_BS = "ours", "ours-host-sampling", "llama-server", "llama-server-bs"
LABELS = {DEVICE: "ours, `--backend_sampling on` (device)", HOST: "ours, `--backend_sampling off` (host)",
          PEER: "llama-server", PEER_BS: "llama-server `-bs`"}
TARGET_RATIO, TARGET_GREEDY, TARGET_SEEDED = 1.2, 6000.0, 0.9  # issue 27's targets at 64 clients
AUTO = "auto / llama-server's best"
AUTO_ARM = HOST  # `--backend_sampling auto` samples every row on the host where the native sampler is built
METHOD = """\
- Model: the 8B-class F16 random-weight target (32 layers, width 4,096) with a 128,341-token
  vocabulary (`write_tiny_llama(..., vocab_extra=127000)`, as `VOCAB_EXTRA=127000 source
  bench/gpu/setup.sh` writes it). Timing does not depend on the weights.
- Servers, loaded at once and driven one at a time: ours `--n_ctx 512 --max_concurrency 64
  --flash_attn true` with `--backend_sampling off` (and `on`, where the table has it); llama-server from the same llama.cpp,
  `-np 64 -c 32768 -fa on --cache-ram 0`, without and with `-bs` (`--backend-sampling`).
- Throughput: each client sends 2 non-streamed /v1/completions one after the other (a random
  32-token prompt), every token generated (ours `min_tokens`, llama-server `ignore_eos`);
  completion tokens from `usage` over the wall time. Every request also sends top_k 40, min_p 0,
  repeat_penalty 1. Reps interleaved: mode by mode, server by server.
- Engine: our engine in the bench's process, 64 requests at once. With the overlap (the GPU's
  default: a step's text and events go out while the next decode runs) and without it, reps
  interleaved, each first in turn; without it each `llama_decode` is also timed with its
  synchronization (so the decode includes the logits copy), and host ms is the rest of the step.
- `auto`, ours' default, was not run as one server: where the native sampler is built (as here)
  it samples every row on the host (docs/sampling.md), so its figures are the host arm's."""


Reps = dict[tuple[str, int, str], list[float]]


def load(paths: list[Path]) -> dict[str, Any]:
    """The results files' rows, arm by arm, and each file's machine."""
    results: dict[str, list[dict[str, Any]]] = {}
    machines = []
    for path in paths:
        data = json.loads(path.read_text())
        run = {"file": path.name, "tree": data["machine"].get("tree") or str(path.resolve())}
        for arm, rows in data["results"].items():
            results.setdefault(arm, []).extend({**row, **run} for row in rows)
        machines.append((path, data["machine"]))
    return {"results": results, "machines": machines}


def sourced_cells(rows: list[dict[str, Any]]) -> tuple[Reps, dict[tuple[str, int, str], list[str]]]:
    """tok/s of every rep, by mode, clients and server, and the files each cell came from: files of
    one tree (the "tree" queue.sh records; else each file is its own) merge their reps, and where
    two trees measured a cell, the later (files are given oldest first) supplies all of them, so a
    cell never mixes two trees."""
    out: Reps = {}
    trees: dict[tuple[str, int, str], str] = {}
    files: dict[tuple[str, int, str], list[str]] = {}
    for row in rows:
        if row.get("kind") == "throughput" and "tok_s" in row:
            key, tree, file = (row["mode"], row["clients"], row["server"]), row.get("tree", ""), row.get("file", "")
            if trees.setdefault(key, tree) != tree:
                trees[key], out[key], files[key] = tree, [], []
            out.setdefault(key, []).append(row["tok_s"])
            if file not in files.setdefault(key, []):
                files[key].append(file)
    return out, files


def cells(rows: list[dict[str, Any]]) -> Reps:
    return sourced_cells(rows)[0]


def arms(reps: Reps) -> list[str]:
    """The servers measured, the known ones in LABELS' order."""
    found = list(dict.fromkeys(server for _, _, server in reps))
    return [s for s in LABELS if s in found] + [s for s in found if s not in LABELS]


def mode_groups(reps: Reps) -> list[tuple[str, int]]:
    """The (mode, clients) measured, by clients, then in MODES' order."""
    order = list(MODES)
    return sorted(dict.fromkeys((m, c) for m, c, _ in reps),
                  key=lambda g: (g[1], order.index(g[0]) if g[0] in order else len(order)))


def describe(mode: str) -> str:
    fields = ", ".join(f"{k} {v}" for k, v in MODES[mode].items())
    return f"{mode} ({fields}{', one client held to a JSON grammar' if mode == 'json_row' else ''})"


def cell(values: list[float] | None, most: int) -> str:
    """The median, the range over reps, and the reps' count where a cell has fewer than the most."""
    if not values:
        return "-"
    fewer = f"; {len(values)} reps" if len(values) < most else ""
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f}{fewer})"


def throughput_table(reps: Reps, files: dict[tuple[str, int, str], list[str]], servers: list[str]) -> list[str]:
    most = max(map(len, reps.values()))
    lines = ["| mode | clients | " + " | ".join(LABELS.get(s, s) for s in servers) + " | data |",
             "|---|---:|" + "---:|" * len(servers) + "---|"]
    for mode, clients in mode_groups(reps):
        row = [cell(reps.get((mode, clients, server)), most) for server in servers]
        sources = dict.fromkeys(f for s in servers for f in files.get((mode, clients, s), []))
        data = ", ".join(f"`{f}`" for f in sources)
        lines.append(f"| {describe(mode)} | {clients} | " + " | ".join(row) + f" | {data} |")
    return lines


def before_table(now: Reps, before: Reps, servers: list[str]) -> list[str]:
    """Each arm's median in the earlier run and in this one, and this one's over the earlier, for the
    cells the earlier run measured."""
    lines = ["| mode | clients | " + " | ".join(f"{LABELS.get(s, s)}: before -> now" for s in servers) + " |",
             "|---|---:|" + "---:|" * len(servers)]
    measured = {k[:2] for k in before}
    for mode, clients in dict.fromkeys((m, c) for m, c, _ in now if (m, c) in measured):
        row = []
        for server in servers:
            old, new = before.get((mode, clients, server)), now.get((mode, clients, server))
            if old and new:
                ratio = statistics.median(new) / statistics.median(old)
                row.append(f"{statistics.median(old):,.0f} -> {statistics.median(new):,.0f} ({ratio:.2f}x)")
            else:
                row.append("- -> " + (f"{statistics.median(new):,.0f}" if new else "-"))
        lines.append(f"| {mode} | {clients} | " + " | ".join(row) + " |")
    return lines


def ratios(median: dict[tuple[str, int, str], float], mode: str, clients: int) -> dict[str, float] | None:
    """Ours' arms (those that ran) over llama-server's, and `auto` over llama-server's faster
    configuration; None without the host arm or either llama-server."""
    if any((mode, clients, s) not in median for s in (AUTO_ARM, PEER, PEER_BS)):
        return None
    peer, peer_bs = median[(mode, clients, PEER)], median[(mode, clients, PEER_BS)]
    found = {"auto": median[(mode, clients, AUTO_ARM)]}
    found[AUTO] = found["auto"] / max(peer, peer_bs)
    for arm, name in ((DEVICE, "device"), (HOST, "host")):
        if (mode, clients, arm) in median:
            found[f"{name} / llama-server"] = median[(mode, clients, arm)] / peer
            found[f"{name} / -bs"] = median[(mode, clients, arm)] / peer_bs
    return found


def ratio_table(median: dict[tuple[str, int, str], float]) -> list[str]:
    names = ["device / llama-server", "device / -bs", "host / llama-server", "host / -bs", AUTO]
    found = {(m, c): r for m, c in dict.fromkeys((m, c) for m, c, _ in median) if (r := ratios(median, m, c))}
    names = [n for n in names if any(n in r for r in found.values())]
    lines = ["| mode | clients | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for (mode, clients), r in found.items():
        lines.append(f"| {mode} | {clients} | " + " | ".join(f"{r[n]:.2f}x" for n in names) + " |")
    return lines


def targets(median: dict[tuple[str, int, str], float]) -> list[str]:
    """Issue 27's targets at 64 clients, against what `auto` would serve."""
    found = {m: r for m, r in ((m, ratios(median, m, c)) for m, c, _ in median if c == 64) if r}
    if not found:
        return []
    missed = [f"{mode} {r[AUTO]:.2f}x" for mode, r in found.items() if r[AUTO] < TARGET_RATIO]
    lines = [f"- At least {TARGET_RATIO}x llama-server's faster configuration in every mode: "
             + (f"missed in {len(missed)} of {len(found)} ({', '.join(missed)})." if missed else f"met in all {len(found)}.")]
    if "greedy" in found:
        greedy = found["greedy"]["auto"]
        lines.append(f"- Greedy at least {TARGET_GREEDY:,.0f} tok/s: {greedy:,.0f}, {'met' if greedy >= TARGET_GREEDY else 'missed'}.")
    if "seeded" in found and "top_p" in found:
        share = found["seeded"]["auto"] / found["top_p"]["auto"]
        lines.append(f"- Seeded within 10% of unseeded (top_p): {share:.2f} of it, {'met' if share >= TARGET_SEEDED else 'missed'}.")
    return lines


def engine_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per mode, backend sampling and overlap (the host's work beside the next decode, or after it):
    medians over reps; decode and host ms only where the decode was timed (no overlap)."""
    steps = [r for r in rows if "step_ms" in r and "trace" not in r]  # traced runs are slowed by the tracer
    if not steps:
        return []
    lines = ["| mode | backend sampling | overlap | reps | tok/s | ms/step | decode ms | host ms |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for key in dict.fromkeys((r["mode"], r["backend_sampling"], r.get("overlap", False)) for r in steps):
        cell = [r for r in steps if (r["mode"], r["backend_sampling"], r.get("overlap", False)) == key]

        def median(name: str, fmt: str = "{:.3f}") -> str:
            values = [r[name] for r in cell if name in r]
            return fmt.format(statistics.median(values)) if values else "-"

        lines.append(f"| {key[0]} | {key[1]} | {'on' if key[2] else 'off'} | {len(cell)} | {median('tok_s', '{:,.0f}')} | "
                     f"{median('step_ms')} | {median('decode_ms')} | {median('host_ms')} |")
    greedy = {r["outputs"] for r in steps if r["mode"] == "greedy"}
    if len({(r["backend_sampling"], r.get("overlap", False)) for r in steps if r["mode"] == "greedy"}) > 1:
        lines += ["", f"Greedy tokens in every arm {'equalled' if len(greedy) == 1 else 'differed from'} each other "
                      "(a hash of every request's tokens)."]
    return lines


def trace_table(rows: list[dict[str, Any]]) -> list[str]:
    """The traced engine runs (`--trace`, CUPTI), per step: the wall time, how long the GPU ran any
    kernel, the logits' copy to the host, the graph launch and the other kernel launches, the host's
    waits for the GPU; then the kernels that took the most GPU time in the first traced run."""
    traced = [r for r in rows if "trace" in r]
    if not traced:
        return []

    def ms(calls: dict[str, list[float]], prefix: str) -> float:
        return sum(v[0] for name, v in calls.items() if name.startswith(prefix))

    lines = ["| mode | overlap | ms/step (traced) | GPU busy ms | GPU idle | D2H copies ms | cudaGraphLaunch ms | "
             "other kernel launches (calls) | cudaStreamSynchronize ms (calls) |", "|---|---|" + "---:|" * 7]
    for r in traced:
        t = r["trace"]
        calls, copies = t["runtime calls [ms, calls] per ubatch"], t["copies"]
        launches = sum(v[1] for name, v in calls.items() if name.startswith("cudaLaunchKernel"))
        sync = calls.get("cudaStreamSynchronize_v3020", [0.0, 0.0])
        idle = 1 - t["gpu_busy_ms_per_ubatch"] / t["wall_ms_per_ubatch"]
        lines.append(f"| {r['mode']} | {'on' if r['overlap'] else 'off'} | {t['wall_ms_per_ubatch']:.2f} | "
                     f"{t['gpu_busy_ms_per_ubatch']:.2f} | {idle:.0%} | {ms(copies, 'memcpy-kind2'):.2f} | "
                     f"{ms(calls, 'cudaGraphLaunch'):.2f} | {launches:.0f} | {sync[0]:.2f} ({sync[1]:.0f}) |")
    kernels = traced[0]["trace"]["kernels [ms, launches] per ubatch"]
    lines += ["", f"Kernels per step: {traced[0]['trace']['kernels_per_ubatch']:.0f}. The most GPU time "
              f"({traced[0]['mode']}, overlap {'on' if traced[0]['overlap'] else 'off'}):", "",
              "| kernel | ms/step | launches/step |", "|---|---:|---:|",
              *(f"| `{name[:70]}` | {v[0]:.3f} | {v[1]:.1f} |" for name, v in list(kernels.items())[:8])]
    return lines


def plot(reps: Reps, before: Reps, servers: list[str], gpu: str, path: Path) -> None:
    """This run's arms, and the earlier run's host arm (hatched) beside this run's where it has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = mode_groups(reps)
    series = [(LABELS.get(s, s).replace("`", ""), s, reps, "") for s in servers]
    if HOST in servers and any(k[2] == HOST and k[:2] in groups for k in before):
        series.insert(servers.index(HOST) + 1, (LABELS[HOST].replace("`", "") + ", earlier run", HOST, before, "//"))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(2.2 + 2.0 * len(groups), 3.8))
    for i, (label, server, source, hatch) in enumerate(series):
        found = [(g, source[(m, c, server)]) for g, (m, c) in enumerate(groups) if (m, c, server) in source]
        mid = [statistics.median(v) for _, v in found]
        spread = [[x - min(v) for x, (_, v) in zip(mid, found)], [max(v) - x for x, (_, v) in zip(mid, found)]]
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g, _ in found], mid, width, yerr=spread,
               capsize=2, label=label, hatch=hatch, fill=not hatch)
    ax.set_xticks(range(len(groups)), [f"{m}\n{c} clients" for m, c in groups])
    ax.set_ylabel("tokens/s (median; whiskers: range over reps)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"Decode at scale, {gpu}, 128K-token vocabulary (higher is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def regenerate(argv: list[str]) -> str:
    """The run's command as bench/gpu/servers.sh takes it: it adds --target and --llama-server."""
    args, skip = [], False
    for i, arg in enumerate(argv[1:]):
        if skip:
            skip = False
        elif arg in ("--target", "--llama-server"):
            skip = True
        else:
            args.append("$OUT/" + Path(arg).name if i and argv[i] == "--out" else arg)
    return f"VOCAB_EXTRA=127000 bash bench/gpu/servers.sh {argv[0]} {' '.join(args)}"


def header(data: dict[str, Any], before: dict[str, Any], reps: Reps) -> list[str]:
    """What ran where, which cells have fewer reps, and how to run it again."""
    counts = sorted({len(v) for v in reps.values()})
    runs = [(p, m, "") for p, m in data["machines"]] + [(p, m, ", earlier run") for p, m in before["machines"]]
    machines = dict.fromkeys(f"{', '.join(m['gpus'])}, {m['cpus']} CPUs" for _, m, _ in runs)
    lines = ["Machine: " + "; ".join(machines) + ".", "", "Commands, as run (the model written beforehand):", ""]
    lines += [f"- `python {' '.join(m['argv'])}` (`{p.name}`{tag}{', tree ' + m['tree'] if m.get('tree') else ''})"
              for p, m, tag in runs]
    lines += ["", f"Throughput: medians of {'/'.join(map(str, counts))} interleaved rep(s) per cell (a cell's count "
              "where it has fewer than the most), the range over reps in brackets; files of one tree (as queue.sh "
              "records it) merge a cell's reps, else the later file (the list above is oldest first) supplies the "
              "cell. Engine: medians over its table's reps.", "",
              f"Regenerate: `{regenerate(data['machines'][0][1]['argv'])}` on the CUDA machine (`--arms servers engine` "
              "for both arms in one file), copy it into `docs/data/`, then `python bench/gpu/decode_scale_report.py "
              "--data docs/data/FILE.json` (without `--data`: the files above; `--before` names the earlier run's). "
              "The report writes this page and its plot."]
    return lines


def earlier(reps: Reps, before: dict[str, Any]) -> Reps:
    """The earlier run's cells, less the rows (mode, clients) whose every cell both sides took from
    one file (nothing to compare)."""
    old = cells(before["results"].get("servers", []))
    same = {k[:2] for k in old} - {k[:2] for k, v in old.items() if reps.get(k) != v}
    return {k: v for k, v in old.items() if k[:2] not in same}


def page(data: dict[str, Any], before: dict[str, Any], notes: str) -> list[str]:
    rows = data["results"].get("servers", [])
    reps, files = sourced_cells(rows)
    old = earlier(reps, before)
    median = {k: statistics.median(v) for k, v in reps.items()}
    failed = [f"- {r.get('server', r.get('kind'))}, {r.get('mode', '')}: {r['error']}" for g in data["results"].values()
              for r in g if "error" in r]
    per_request = {r["tokens"] // (2 * r["clients"]) for r in rows if r.get("kind") == "throughput" and "tokens" in r}
    engine = data["results"].get("engine") or before["results"].get("engine", [])
    engine_run = "" if data["results"].get("engine") else f" (earlier run, {BEFORE_LABEL})"
    trace = trace_table(engine)
    return [
        "# Decode at scale on a 128K-token vocabulary: ours against llama-server, per sampling mode", "",
        *header(data, before, reps), "", "## Method", "", METHOD, "", "![tokens/s per mode and arm](decode_scale.png)", "",
        f"## Throughput, tok/s ({'/'.join(map(str, sorted(per_request)))} tokens per request)", "",
        *throughput_table(reps, files, arms(reps)), "",
        *([f"## Against the earlier run ({BEFORE_LABEL})", "",
           "Medians, tok/s; in brackets this run's over the earlier one's. llama-server is the same build in "
           "both runs, so its ratios show how far the runs differ apart from ours' changes.", "", *before_table(reps, old, arms(reps)), ""]
          if old else []),
        "## Ratios: ours over llama-server", "",
        "device: ours with `--backend_sampling on`; host: ours with `off`; llama-server: without `-bs`; -bs: with it. "
        "`auto / llama-server's best` divides the host arm (what ours' default `auto` uses where the native sampler "
        "is built) by the faster of llama-server's two.", "", *ratio_table(median), "",
        "## Issue 27's targets (one H200, 64 clients)", "", *targets(median), "",
        f"## The engine's time per step{engine_run}", "", *engine_table(engine), "",
        *(["## Where a step's time goes (CUPTI trace of the engine arm, `--trace`)", "", *trace, ""] if trace else []),
        *(["## Failed runs", "", *failed, ""] if failed else []),
        "<!-- notes -->" + notes,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", default=DATA, help="decode_scale.py results files")
    parser.add_argument("--before", type=Path, nargs="*", default=BEFORE, help="an earlier run's results files")
    parser.add_argument("--out-dir", dest="out_dir", type=Path, default=DOCS, help="where decode_scale.md and .png go")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="the page only (no matplotlib)")
    args = parser.parse_args(argv)
    data, before = load(args.data), load(args.before)
    target = args.out_dir / "decode_scale.md"
    old = target.read_text() if target.exists() else ""
    notes = old.split("<!-- notes -->", 1)[1] if "<!-- notes -->" in old else "\n"
    if args.plot:
        reps = cells(data["results"].get("servers", []))
        gpu = data["machines"][0][1]["gpus"][0].split(",")[0] if data["machines"][0][1]["gpus"] else "no GPU"
        plot(reps, earlier(reps, before), arms(reps), gpu, args.out_dir / "decode_scale.png")
    target.write_text("\n".join(page(data, before, notes)))


if __name__ == "__main__":
    main()

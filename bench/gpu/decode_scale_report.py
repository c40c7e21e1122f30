"""docs/decode_scale.md and docs/decode_scale.png from bench/gpu/decode_scale.py's results.

    python bench/gpu/decode_scale_report.py

By default it reads docs/data/decode_scale_h200.json (the `servers` arm) and
docs/data/decode_scale_engine_h200.json (the `engine` arm); `--data` takes any results files of
decode_scale.py, their arms merged. The page's text below `<!-- notes -->` is kept.
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
DATA = [DOCS / "data" / "decode_scale_h200.json", DOCS / "data" / "decode_scale_engine_h200.json"]
DEVICE, HOST, PEER, PEER_BS = "ours", "ours-host-sampling", "llama-server", "llama-server-bs"
LABELS = {DEVICE: "ours, `--backend_sampling on` (device)", HOST: "ours, `--backend_sampling off` (host)",
          PEER: "llama-server", PEER_BS: "llama-server `-bs`"}
TARGET_RATIO, TARGET_GREEDY, TARGET_SEEDED = 1.2, 6000.0, 0.9  # issue 27's targets at 64 clients
AUTO = "auto / llama-server's best"
METHOD = """\
- Model: the 8B-class F16 random-weight target (32 layers, width 4,096) with a 128,341-token
  vocabulary (`write_tiny_llama(..., vocab_extra=127000)`, as `VOCAB_EXTRA=127000 source
  bench/gpu/setup.sh` writes it). Timing does not depend on the weights.
- Servers, loaded at once and driven one at a time: ours `--n_ctx 512 --max_concurrency 64
  --flash_attn true` with `--backend_sampling on` and `off`; llama-server from the same llama.cpp,
  `-np 64 -c 32768 -fa on --cache-ram 0`, without and with `-bs` (`--backend-sampling`).
- Throughput: each client sends 2 non-streamed /v1/completions one after the other (a random
  32-token prompt), every token generated (ours `min_tokens`, llama-server `ignore_eos`);
  completion tokens from `usage` over the wall time. Every request also sends top_k 40, min_p 0,
  repeat_penalty 1. Reps interleaved: mode by mode, server by server.
- Engine: our engine in the bench's process, 64 requests at once, each `llama_decode` timed with its
  synchronization (so the decode includes the logits copy); host ms is the rest of the step.
- `auto`, ours' default, was not run as one server: on a GPU it samples greedy rows on the host and
  rows at temperature > 0 on the device (docs/sampling.md), so its column takes the arm it would
  use."""


def load(paths: list[Path]) -> dict[str, Any]:
    """The results files' rows, arm by arm, and each file's machine."""
    results: dict[str, list[dict[str, Any]]] = {}
    machines = []
    for path in paths:
        data = json.loads(path.read_text())
        for arm, rows in data["results"].items():
            results.setdefault(arm, []).extend(rows)
        machines.append((path, data["machine"]))
    return {"results": results, "machines": machines}


def cells(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str], list[float]]:
    """tok/s of every rep, by mode, clients and server."""
    out: dict[tuple[str, int, str], list[float]] = {}
    for row in rows:
        if row.get("kind") == "throughput" and "tok_s" in row:
            out.setdefault((row["mode"], row["clients"], row["server"]), []).append(row["tok_s"])
    return out


def arms(reps: dict[tuple[str, int, str], list[float]]) -> list[str]:
    """The servers measured, the known ones in LABELS' order."""
    found = list(dict.fromkeys(server for _, _, server in reps))
    return [s for s in LABELS if s in found] + [s for s in found if s not in LABELS]


def auto_arm(mode: str) -> str:
    """The arm ours' default (`--backend_sampling auto`, on a GPU) samples this mode's rows on."""
    return HOST if MODES[mode].get("temperature", 1.0) == 0 else DEVICE


def describe(mode: str) -> str:
    fields = ", ".join(f"{k} {v}" for k, v in MODES[mode].items())
    return f"{mode} ({fields}{', one client held to a JSON grammar' if mode == 'json_row' else ''})"


def throughput_table(reps: dict[tuple[str, int, str], list[float]], servers: list[str]) -> list[str]:
    lines = ["| mode | clients | " + " | ".join(LABELS.get(s, s) for s in servers) + " |",
             "|---|---:|" + "---:|" * len(servers)]
    for mode, clients in dict.fromkeys((m, c) for m, c, _ in reps):
        row = []
        for server in servers:
            values = reps.get((mode, clients, server))
            row.append(f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})" if values else "-")
        lines.append(f"| {describe(mode)} | {clients} | " + " | ".join(row) + " |")
    return lines


def ratios(median: dict[tuple[str, int, str], float], mode: str, clients: int) -> dict[str, float] | None:
    """Ours' arms over llama-server's, and `auto` over llama-server's faster configuration."""
    if any((mode, clients, s) not in median for s in (DEVICE, HOST, PEER, PEER_BS)):
        return None
    device, host, peer, peer_bs = (median[(mode, clients, s)] for s in (DEVICE, HOST, PEER, PEER_BS))
    mine, best = median[(mode, clients, auto_arm(mode))], max(peer, peer_bs)
    return {"device / llama-server": device / peer, "device / -bs": device / peer_bs,
            "host / llama-server": host / peer, "host / -bs": host / peer_bs, AUTO: mine / best, "auto": mine}


def ratio_table(median: dict[tuple[str, int, str], float]) -> list[str]:
    names = ["device / llama-server", "device / -bs", "host / llama-server", "host / -bs", AUTO]
    lines = ["| mode | clients | `auto` samples on | " + " | ".join(names) + " |",
             "|---|---:|---|" + "---:|" * len(names)]
    for mode, clients in dict.fromkeys((m, c) for m, c, _ in median):
        found = ratios(median, mode, clients)
        if found:
            lines.append(f"| {mode} | {clients} | {'host' if auto_arm(mode) == HOST else 'device'} | "
                         + " | ".join(f"{found[n]:.2f}x" for n in names) + " |")
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
    steps = [r for r in rows if "step_ms" in r]
    if not steps:
        return []
    lines = ["| mode | backend sampling | tok/s | steps | ms/step | decode ms | host ms |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['mode']} | {r['backend_sampling']} | {r['tok_s']:,.0f} | {r['steps']} | {r['step_ms']} | "
              f"{r['decode_ms']} | {r['host_ms']} |" for r in steps]
    greedy = {r["backend_sampling"]: r["outputs"] for r in steps if r["mode"] == "greedy"}
    if len(greedy) == 2:
        same = len(set(greedy.values())) == 1
        lines += ["", f"Greedy tokens with the device on {'equalled' if same else 'differed from'} those with it off "
                      "(a hash of every request's tokens)."]
    return lines


def plot(reps: dict[tuple[str, int, str], list[float]], servers: list[str], gpu: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((m, c) for m, c, _ in reps))
    width = 0.8 / len(servers)
    fig, ax = plt.subplots(figsize=(2.2 + 2.0 * len(groups), 3.8))
    for i, server in enumerate(servers):
        values = [reps.get((m, c, server), [0.0]) for m, c in groups]
        mid = [statistics.median(v) for v in values]
        spread = [[x - min(v) for x, v in zip(mid, values)], [max(v) - x for x, v in zip(mid, values)]]
        ax.bar([g + (i - (len(servers) - 1) / 2) * width for g in range(len(groups))], mid, width, yerr=spread,
               capsize=2, label=LABELS.get(server, server).replace("`", ""))
    ax.set_xticks(range(len(groups)), [f"{m}, {c} clients" for m, c in groups])
    ax.set_ylabel("tokens/s (median; whiskers: range over reps)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"Decode at scale, {gpu}, 128K-token vocabulary (higher is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header(data: dict[str, Any], reps: dict[tuple[str, int, str], list[float]]) -> list[str]:
    """What ran where, and how to run it again."""
    counts = sorted({len(v) for v in reps.values()})
    machines = dict.fromkeys(f"{', '.join(m['gpus'])}, {m['cpus']} CPUs" for _, m in data["machines"])
    lines = ["Machine: " + "; ".join(machines) + ".", "", "Commands, as run (the model written beforehand to /tmp/models/t.gguf):", ""]
    lines += [f"- `python {' '.join(m['argv'])}` (`{p.name}`)" for p, m in data["machines"]]
    lines += ["", f"Throughput: medians of {'/'.join(map(str, counts))} interleaved rep(s) per cell, "
              "the range over reps in brackets. Engine: one run per row.", "",
              "Regenerate: `VOCAB_EXTRA=127000 bash bench/gpu/servers.sh bench/gpu/decode_scale.py --out "
              "$OUT/decode_scale.json --modes greedy top_p seeded` on the CUDA machine (both arms into one file), "
              "copy it into `docs/data/`, then `python bench/gpu/decode_scale_report.py --data docs/data/FILE.json` "
              "(without `--data`: the two files above). The report writes this page and its plot."]
    return lines


def page(data: dict[str, Any], notes: str) -> list[str]:
    rows = data["results"].get("servers", [])
    reps = cells(rows)
    median = {k: statistics.median(v) for k, v in reps.items()}
    failed = [f"- {r.get('server', r.get('kind'))}, {r.get('mode', '')}: {r['error']}" for g in data["results"].values()
              for r in g if "error" in r]
    per_request = {r["tokens"] // (2 * r["clients"]) for r in rows if r.get("kind") == "throughput" and "tokens" in r}
    return [
        "# Decode at scale on a 128K-token vocabulary: ours against llama-server, per sampling mode", "",
        *header(data, reps), "", "## Method", "", METHOD, "", "![tokens/s per mode and arm](decode_scale.png)", "",
        f"## Throughput, tok/s ({'/'.join(map(str, sorted(per_request)))} tokens per request)", "",
        *throughput_table(reps, arms(reps)), "",
        "## Ratios: ours over llama-server", "",
        "device: ours with `--backend_sampling on`; host: ours with `off`; llama-server: without `-bs`; -bs: with it. "
        "`auto / llama-server's best` divides the arm ours' default uses by the faster of llama-server's two.", "", *ratio_table(median), "",
        "## Issue 27's targets (one H200, 64 clients)", "", *targets(median), "",
        "## The engine's time per step", "", *engine_table(data["results"].get("engine", [])), "",
        *(["## Failed runs", "", *failed, ""] if failed else []),
        "<!-- notes -->" + notes,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", default=DATA, help="decode_scale.py results files")
    parser.add_argument("--out-dir", dest="out_dir", type=Path, default=DOCS, help="where decode_scale.md and .png go")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="the page only (no matplotlib)")
    args = parser.parse_args(argv)
    data = load(args.data)
    target = args.out_dir / "decode_scale.md"
    old = target.read_text() if target.exists() else ""
    notes = old.split("<!-- notes -->", 1)[1] if "<!-- notes -->" in old else "\n"
    if args.plot:
        reps = cells(data["results"].get("servers", []))
        gpu = data["machines"][0][1]["gpus"][0].split(",")[0] if data["machines"][0][1]["gpus"] else "no GPU"
        plot(reps, arms(reps), gpu, args.out_dir / "decode_scale.png")
    target.write_text("\n".join(page(data, notes)))


if __name__ == "__main__":
    main()

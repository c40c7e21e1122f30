"""Host cost of admission per step: `Scheduler.admit()` (run at every step) with 64 slots decoding
and N requests queued behind them, on the mock runner (no model), in this tree and optionally in
another revision's, to show that the admission policies (engine/admission.py, lending.py) cost what
the deque handling before them did.

    python bench/admission_cost.py [--baseline-tree /tmp/base] [--queued 0 64 512] [--policy fcfs]

`--baseline-tree`: a checkout of the other revision (`git archive REV | tar -x -C DIR`); each tree is
measured in a process of its own, importing its own code. Prints the median of 200 calls per row.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_MEASURE = """
import statistics, sys, time
from mock_runner import make_request, make_scheduler, step_once
n_queued, per_slot, policy = int(sys.argv[1]), sys.argv[2] == "per_slot", sys.argv[3]
kw = {} if policy == "fcfs" else {"schedule_policy": policy}
sched, runner = make_scheduler(n_slots=64, n_pages=64 if per_slot else 4096, page_size=16, max_batch_tokens=512,
                               max_ctx=1024, max_queue=1024, check_every_step=False, per_slot=per_slot, **kw)
sched.submit(*[make_request([i, 1, 2, 3], max_tokens=100000) for i in range(64)])
for _ in range(3):
    step_once(sched, runner)
for k in range(n_queued):
    sched.add(make_request([5000 + k, 7, 8], max_tokens=4))
times = []
for _ in range(200):
    start = time.perf_counter()
    sched.admit()
    times.append(time.perf_counter() - start)
print(f"{statistics.median(times) * 1e6:.1f}")
"""


def measure(tree: Path, queued: int, layout: str, policy: str) -> str:
    env_path = f"{tree}:{tree / 'tests'}"
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(queued), layout, policy], capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-tree", type=Path)
    parser.add_argument("--queued", type=int, nargs="+", default=[0, 64, 512])
    parser.add_argument("--policy", default="fcfs", help="this tree's --schedule_policy (the baseline's: its own)")
    args = parser.parse_args()
    print("| layout | queued | this tree (us) |" + (" baseline (us) |" if args.baseline_tree else ""))
    print("|---|---|---|" + ("---|" if args.baseline_tree else ""))
    for layout in ("unified", "per_slot"):
        for queued in args.queued:
            row = f"| {layout} | {queued} | {measure(REPO, queued, layout, args.policy)} |"
            if args.baseline_tree:
                row += f" {measure(args.baseline_tree, queued, layout, 'fcfs')} |"
            print(row)


if __name__ == "__main__":
    main()

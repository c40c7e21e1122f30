"""Online serving benchmark on the CPU (issue 48), after `vllm bench serve`: Poisson arrivals swept over
rates, ShareGPT prompts and answer lengths plus a share of long (RAG-sized) prompts, streamed
/v1/completions; TTFT, ITL, TPOT percentiles, throughput and goodput under a stated objective.

Arms (all up at once, driven one at a time, side by side at each rate, order rotated each rep):
ours with PFlash off and with `--pflash auto` (two servers, so that neither finds the other's prompts
in its prefix cache), stock `llama_cpp.server`, llama-cpp-python's example server where its script
is found (bench/upstream.py: PFLASH_UPSTREAM_SERVER, PFLASH_UPSTREAM_SITE), and llama-server with and
without `-bs` where `--llama-server BIN` names one.

Scaled to 2 CPU cores and the demo model (gemma-3-270m Q4_K_M): answers are ShareGPT's lengths
times 0.25 (median 35 tokens), long prompts 1-6K tokens (the field's 4-32K over 4, capped by n_ctx
8192) for 10% of requests (needle-in-a-haystack prose with its question at the end, completion style).

    python bench/online.py [--reps 3] [--rates 0.15 0.3 0.6 1.2] [--ours-tree DIR]   # -> docs/data/online_cpu.json
    python bench/online.py --report                                                 # -> docs/online.md + PNGs
    python bench/online.py --arms ours ours-base --base-tree DIR --out F; python bench/online.py --tables F
                                                            # a change's before (DIR) and after, interleaved
                                                            # (ours-pflash-auto-base: the base with --pflash auto)
"""
from __future__ import annotations

import os
import sys

# `python bench/online.py` puts bench/ first on sys.path, where bench scripts could shadow the standard
# library: move it last, where `harness` and the online_* modules are still found.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))

import argparse
import json
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from harness import REPO, ServerProcess, arm_items, demo_model_path, machine, uptime
from online_data import Item, Mix, demo_counter, long_length, scaled, sharegpt_pairs
from online_load import OURS_FIELDS, Objective
from online_sweep import Arm, Sweep, eog_tokens, wait_idle
from upstream import UpstreamServer, available, model_options

from pflash_plugin.testing.haystack import fit_needle_prompt

OUT = REPO / "docs" / "data" / "online_cpu.json"
MIX = Mix(long_share=0.1, long_low=1024, long_high=6144, output_scale=0.25)
OBJECTIVE = Objective(ttft_s=2.0, tpot_s=0.25)  # the CPU's scale of TTFT <= 1 s, TPOT <= 100 ms on a GPU
WINDOW_S = 40.0  # each run's arrivals span about this long (at least MIN_REQUESTS requests); at 20 s a run of a
# dozen requests turned on one long prompt: the peak ratios over the example server moved 1.01x -> 1.26x between runs
MIN_REQUESTS = 6
SLOT_CELLS = 8192  # each slot's context in every server (ours' --n_ctx, the example server's and llama-server's per slot)
DRAIN_S = 20.0  # after the last arrival, a run may take this long before its requests are cut


def arms(args: argparse.Namespace, log_dir: Path) -> list[Arm]:
    model, eog = demo_model_path(), eog_tokens(demo_model_path())
    tree = Path(args.ours_tree) if args.ours_tree else REPO
    ours_args = ["--model", model, "--n_ctx", str(SLOT_CELLS), "--max_concurrency", str(args.slots)]

    def ours(label: str, log_label: str, extra: list[str], cwd: Path = tree, env: dict[str, str] | None = None) -> Arm:
        """Ours with these flags, run from `cwd`, asking for its usage chunk (online_load.OURS_FIELDS)."""
        server = ServerProcess(log_label, [*ours_args, *extra], env=env or {}, cwd=cwd, log_dir=log_dir,
                               ready_paths=("/health",))
        return Arm(label, server, "min_tokens", OURS_FIELDS)

    out = [
        ours("ours", "online-ours", []),
        ours("ours-pflash-auto", "online-ours-auto", ["--pflash", "auto"]),
        Arm("stock", ServerProcess("online-stock", ["--model", model, "--n_ctx", str(SLOT_CELLS), "--interrupt_requests",
                                                    "false"], module="llama_cpp.server", log_dir=log_dir), "min_tokens"),
    ]
    for arm in args.ours_arms:  # NAME=ITEMS: ours (PFlash off) with these flags and environment (harness.arm_items)
        name, extra, env = arm_items(arm)
        out.append(ours(f"ours-{name}", f"online-ours-{name}", extra, env=env))
    if args.base_tree:  # ours from another tree, beside this one's: a change's before and after (PFlash off, auto)
        for name, extra in (("ours-base", []), ("ours-pflash-auto-base", ["--pflash", "auto"])):
            out.append(ours(name, f"online-{name}", extra, cwd=Path(args.base_tree)))
    if available():  # as serving.py runs it: a sequence of 8,192 cells a slot, n_batch 512
        options = model_options(model, slots=args.slots, n_ctx=args.slots * SLOT_CELLS, gpu=False, n_batch=512, n_ubatch=512)
        out.append(Arm("upstream", UpstreamServer("online-upstream", [], log_dir=log_dir,
                                                  options={**options, "kv_unified": False}), "logit_bias", eog=eog))
    if args.llama_server:  # per slot count: llama-server and llama-server-bs at --slots, llama-server-npN ... at N
        for slots in args.llama_server_slots or [args.slots]:
            for base, extra in (("llama-server", []), ("llama-server-bs", ["-bs"])):
                label = base if slots == args.slots else f"{base}-np{slots}"
                server = ServerProcess(f"online-{label}", ["-m", model, "--host", "127.0.0.1", "-c", str(slots * SLOT_CELLS),
                                                           "-np", str(slots), "-fa", "on", *extra],
                                       program=[args.llama_server], log_dir=log_dir, ready_paths=("/health",))
                out.append(Arm(label, server, "ignore_eos"))
    return out


class CpuItems:
    """A run's requests: the same for every arm; different for each rate and rep (no prefix reuse)."""

    def __init__(self, window_s: float, seed: int = 0) -> None:
        self.window_s = window_s
        self.count = demo_counter()
        self.pairs = sharegpt_pairs(self.count, 3000, seed)
        self.cache: dict[tuple[float, int], list[Item]] = {}

    def __call__(self, rate: float, rep: int, _arm: int) -> list[Item]:
        if (rate, rep) not in self.cache:
            self.cache[(rate, rep)] = self.build(rate, rep)
        return self.cache[(rate, rep)]

    def build(self, rate: float, rep: int) -> list[Item]:
        n = max(MIN_REQUESTS, round(rate * self.window_s))
        rng = random.Random(f"{rate}-{rep}")
        items = []
        for kind in MIX.kinds(n, rng):
            prompt, n_prompt, n_answer = self.pairs[rng.randrange(len(self.pairs))]
            if kind == "long":
                target = long_length(rng, MIX.long_low, MIX.long_high)
                prompt, _, n_prompt = fit_needle_prompt(self.count, target, "prose", rng.random(), rng.randrange(10**6))
            items.append(Item(prompt, n_prompt, scaled(n_answer, MIX.output_scale), kind))
        return items


def commit(tree: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return f"{done.stdout.strip()}{'' if tree == REPO else ' (ours from ' + str(tree) + ')'}"


def measure(args: argparse.Namespace) -> None:
    log_dir = REPO / "bench" / "results" / "logs"
    the_arms = [a for a in arms(args, log_dir) if not args.arms or a.label in args.arms]
    items = CpuItems(args.window_s)
    meta: dict[str, Any] = {
        "bench": "online", "device": "cpu", "machine": machine(), "uptime_at_start": uptime(),
        "command": " ".join(["python", "bench/online.py", *sys.argv[1:]]), "commit": commit(Path(args.ours_tree or REPO)),
        "mix": MIX.__dict__, "slots": args.slots, "window_s": args.window_s, "min_requests": MIN_REQUESTS, "drain_s": args.drain_s,
        "model": "gemma-3-270m Q4_K_M (demo)",
    }
    sweep = Sweep(the_arms, args.rates, args.reps, items, OBJECTIVE, lambda last: last + args.drain_s, args.out, meta,
                  budget_s=args.budget_s)
    if args.resume:  # a sweep cut by its budget: its runs kept, the missing ones run (the same requests: seeded)
        before = json.loads(args.resume.read_text())
        sweep.rows = before["runs"]
        meta.update(command=f"{before['command']}; resumed by {meta['command']}", commit=before["commit"],
                    uptime_at_start=before["uptime_at_start"], uptime_at_resume=meta["uptime_at_start"])
    try:
        for arm in the_arms:
            arm.server.launch()
        for arm in the_arms:
            arm.server.wait_ready(600)
            wait_idle(arm, 300.0)  # a first request: warm
        sweep.run(lambda message: print(message, file=sys.stderr, flush=True))
    finally:
        for arm in the_arms:
            arm.server.stop()
    sweep.meta["uptime_at_end"] = uptime()
    sweep.write(complete=len(sweep.rows) == len(the_arms) * len(args.rates) * args.reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.15, 0.3, 0.6, 1.2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--arms", nargs="*", help="only these arms (labels)")
    parser.add_argument("--ours-tree", help="a copy of the project to run ours from (e.g. `git archive HEAD`)")
    parser.add_argument("--ours-arms", dest="ours_arms", nargs="*", default=[], metavar="NAME=FLAGS",
                        help="also ours (PFlash off) with these flags, an arm each: u8=--max_concurrency,8,--kv_layout,unified")
    parser.add_argument("--base-tree", help="another copy of the project: adds arms ours-base "
                        "(PFlash off) and ours-pflash-auto-base run from it (--arms picks)")
    parser.add_argument("--tables", type=Path, help="only print the tables of this data file (e.g. a --base-tree run's)")
    parser.add_argument("--llama-server", help="a llama-server binary: adds its arms (with and without -bs)")
    parser.add_argument("--slots", type=int, default=8, help="every server's slots, of 8,192 cells each (8: each "
                        "server's best of 4, 8 and 16 on the 2-core CPU, docs/online.md)")
    parser.add_argument("--llama-server-slots", type=int, nargs="+", default=None, metavar="N",
                        help="llama-server's arms at each of these slot counts (default: --slots)")
    parser.add_argument("--window-s", type=float, default=WINDOW_S, help="each run's arrivals span about this long")
    parser.add_argument("--drain-s", type=float, default=DRAIN_S, help="a run's requests are cut this long after its last arrival")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="no run starts after this many seconds")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--resume", type=Path, help="a sweep's data file that its budget cut: run only the runs it "
                        "lacks (same arms, rates and reps), its own kept, all written to --out")
    parser.add_argument("--report", action="store_true", help="only write docs/online.md and its plots")
    args = parser.parse_args()
    if args.tables:
        from online_report import medians, tables

        data = json.loads(args.tables.read_text())
        print(tables(data, medians(data)))
        return 0
    if args.report:
        from online_report import write_page

        print(write_page())
        return 0
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    start = time.time()
    measure(args)
    print(f"{args.out} in {time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

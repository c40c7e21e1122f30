"""The engine's decode step beside a busy Python thread, with the step's short calls after the decode
(the logits' read on the CPU, the native sampler, the grammar masks) keeping the GIL (this tree) or
releasing it (ctypes' default, as before): 64 greedy rows of the tiny model at a 128K
vocabulary, the arms interleaved, each in its own process, ms a step per rep.

    python bench/engine_gil.py [--reps 3] [--quiet]

A released call lets a thread that runs Python take the GIL, and the engine thread then waits for it
to come back (up to the switch interval) before it can launch the next step.
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


def child(arm: str, busy: bool, path: str) -> list[float]:
    """ms a step over 4 rounds of 64 requests x 48 tokens (the first a warm-up, left out after)."""
    from pflash_plugin.engine.loader import EngineConfig, load_engine
    from pflash_plugin.engine.request import Request, SamplingParams
    from pflash_plugin.llama import native

    if arm == "release":  # the bindings as ctypes makes them: the GIL released around the calls
        import llama_cpp.llama_cpp as C

        from pflash_plugin.llama import context

        native.held = lambda name: getattr(native.load(), name)  # type: ignore[assignment]
        context._get_logits_held, context._get_logits_ith_held = C.llama_get_logits, C.llama_get_logits_ith
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import run_requests

    stop = threading.Event()

    def spin() -> None:  # Python in bursts, as an event loop streaming answers or parsing bodies
        while not stop.is_set():
            sum(range(20000))

    model, engine = load_engine(path, EngineConfig(n_slots=64, max_ctx=256, n_batch=256, n_threads=2,
                                                   n_threads_batch=2))
    spinner = threading.Thread(target=spin, daemon=True)
    if busy:
        spinner.start()
    try:
        steps = []
        for _ in range(4):
            requests = [Request(model.tokenize(f"the water {i} is", True),
                                SamplingParams(max_tokens=48, min_tokens=48, temperature=0.0)) for i in range(64)]
            before, start = engine.steps, time.perf_counter()
            run_requests(engine, requests)
            steps.append(1000 * (time.perf_counter() - start) / (engine.steps - before))
        return steps[1:]
    finally:
        stop.set()
        engine.stop()
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quiet", action="store_true", help="no busy thread beside")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == "busy", args.model)))
        return
    from pflash_plugin.llama.tiny_gguf import write_tiny_llama

    model = Path("/tmp/engine-gil-v128k.gguf")
    if not model.exists():
        write_tiny_llama(model, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, vocab_extra=127000)
    load = "quiet" if args.quiet else "busy"
    runs: dict[str, list[float]] = {"release": [], "hold": []}
    for rep in range(args.reps):
        for arm in (("release", "hold") if rep % 2 == 0 else ("hold", "release")):
            out = subprocess.run([sys.executable, __file__, "--child", arm, load, "--model", str(model)],
                                 capture_output=True, text=True, check=True, cwd=REPO).stdout
            runs[arm].append(statistics.median(json.loads(out.splitlines()[-1])))
            print(f"rep {rep} {arm} ({load}): {runs[arm][-1]:.1f} ms a step", flush=True)
    for arm, values in runs.items():
        print(f"{arm}: median {statistics.median(values):.1f} ms a step ({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()

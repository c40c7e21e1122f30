"""The vision workload's steps, one by one (issue 46): N image + question requests straight to an
engine in the GPU's order and step rules on the CPU (the runner overlapping, the GPU's step chunks,
n_batch 2048 / n_ubatch 512, a KV stream per slot, steady decode steps), the tiny llama with a tiny
projector of the real shape's 576 tokens an image. Per step: its composition (decode rows, text
chunks, media pieces, fillers, slots), the ubatches llama.cpp splits each of its `llama_decode`
calls into, and the graphs it reused.

Ubatches: with a KV stream per slot llama.cpp splits a batch by `llama_batch_allocr::split_equal(
n_ubatch, sequential=true)` (src/llama-batch.cpp): a ubatch takes a run of CONSECUTIVE sequence ids
starting at the batch's first unused row, and the same number of rows from each (the fewest any of
them has left, at most n_ubatch / their count). `ubatches` below is that rule on each call's rows;
each ubatch reads all the weights on a GPU, and one of another shape than the one before builds a
new graph (llm_graph_params::allow_reuse; on a GPU no CUDA graph replay). Graph reuse is llama.cpp's
own count (llama_perf_context n_reused, Context.graph_reuses), the same on the CPU as on a GPU.

    PYTHONPATH=. python bench/vision_steps.py --clients 8 32 --gap_ms 5 --encode_ms 20 --encoders 4 \
        --out docs/data/vision_steps_cpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

# `--trees`' children import another checkout's pflash_plugin (VISION_STEPS_TREE), this one's otherwise
sys.path.insert(0, os.environ.get("VISION_STEPS_TREE") or str(Path(__file__).resolve().parent.parent))

from pflash_plugin.engine.media import MEDIA_MARKER, MediaInput  # noqa: E402
from pflash_plugin.engine.request import (ErrorEvent, FinishEvent, Request, RequestStatus,  # noqa: E402
                                          SamplingParams, TextEvent)
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector  # noqa: E402
from pflash_plugin.testing.media_files import png  # noqa: E402

def _rule() -> Any:
    """This checkout's llama/ubatches.py (a tree before it has none: `--trees`), loaded by its path."""
    path = Path(__file__).resolve().parent.parent / "pflash_plugin" / "llama" / "ubatches.py"
    spec = importlib.util.spec_from_file_location("vision_steps_ubatches", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


split_equal = _rule().split_equal
PROMPT = f"<|im_start|>user\nDescribe the picture.\n{MEDIA_MARKER}<|im_end|>\n<|im_start|>assistant\n"
PROJECTOR = {"image_size": 336, "patch_size": 14, "n_layer": 2}  # 576 tokens an image, as LLaVA 1.5's


def merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent runs of one sequence as one."""
    out: list[tuple[int, int]] = []
    for seq, n in runs:
        if out and out[-1][0] == seq:
            out[-1] = (seq, out[-1][1] + n)
        else:
            out.append((seq, n))
    return out


class Recorder:
    """Wraps the runner's launch and collect and its context's decode: a row per step."""

    def __init__(self, engine: Any, calls: ForeignCalls | None) -> None:
        self.runner, self.ctx, self.calls = engine.runner, engine.runner.ctx, calls
        self.steps: list[dict[str, Any]] = []
        self._calls: list[dict[str, Any]] = []
        self._launched = 0.0
        launch, collect, decode = self.runner.launch, self.runner.collect, self.ctx.decode

        def decode_call(batch: Any) -> None:
            raw = batch.raw
            seqs = [raw.seq_id[i][0] for i in range(batch.n_tokens)]
            runs = [(seq, 1) for seq in seqs]  # merged below: a sequence's rows are together
            before, start = self.ctx.graph_reuses(), time.perf_counter()
            try:
                decode(batch)
            finally:
                self._calls.append({"media": bool(raw.embd), "rows": batch.n_tokens,
                                    "ubatches": split_equal(merged(runs), self.ctx.n_ubatch),
                                    "reused": self.ctx.graph_reuses() - before,
                                    "ms": round(1000 * (time.perf_counter() - start), 3)})

        def launch_step(step: Any) -> None:
            self._calls, start = [], time.perf_counter()
            if self.steps:  # the last step's launch to this one's: the engine's whole round
                self.steps[-1]["round_ms"] = round(1000 * (start - self._launched), 3)
            if self.calls is not None:
                self.calls.thread = threading.get_ident()
                if self.steps:
                    self.steps[-1]["foreign_calls"] = self.calls.take()
            self._launched = start
            try:
                launch(step)
            finally:
                self.steps.append(self.row(step, time.perf_counter() - start))

        def collect_step(step: Any) -> Any:
            start = time.perf_counter()
            try:
                return collect(step)
            finally:
                self.steps[-1]["collect_ms"] = round(1000 * (time.perf_counter() - start), 3)

        self.ctx.decode, self.runner.launch, self.runner.collect = decode_call, launch_step, collect_step

    def row(self, step: Any, launch_s: float) -> dict[str, Any]:
        """One step: what it held and what llama.cpp made of it."""
        items = step.items
        decoding = [i for i in items if i.filler or (i.media is None and i.request.status is RequestStatus.DECODING)]
        chunks = [len(i.tokens) for i in items if i.media is None and not i.filler
                  and i.request.status is not RequestStatus.DECODING]
        calls = self._calls
        return {"decode_rows": sum(not i.filler for i in decoding), "fillers": sum(i.filler for i in decoding),
                "text_chunks": chunks, "media_pieces": [len(i.tokens) for i in items if i.media is not None],
                "slots": [i.request.held_slot for i in items],
                "media_calls": [c["rows"] for c in calls if c["media"]],
                "ubatches": sum(len(c["ubatches"]) for c in calls),
                "media_ubatches": sum(len(c["ubatches"]) for c in calls if c["media"]),
                "token_ubatches": [list(u) for c in calls if not c["media"] for u in c["ubatches"]],
                "reused": sum(c["reused"] for c in calls),
                "decode_ms": round(sum(c["ms"] for c in calls), 3),
                "launch_ms": round(1000 * launch_s, 3)}


def workload(args: argparse.Namespace, clients: int, seed: int, calls: ForeignCalls | None) -> list[dict[str, Any]]:
    """`clients` image requests submitted `args.gap_ms` apart (their preparation's spread over HTTP)
    to a fresh engine in the GPU's order, each encode taking `args.encode_ms` more (a GPU's ViT took
    ~20 ms an image, 4 at once, beside the engine's steps); the rows of its steps."""
    from pflash_plugin.engine import loader

    chunks = loader.step_chunks
    loader.step_chunks = lambda chunk, on_gpu: chunks(chunk, True)  # type: ignore[assignment]
    config = loader.EngineConfig(max_ctx=1024, n_slots=clients + 1, n_batch=2048, n_ubatch=args.n_ubatch,
                                 n_threads=1, n_threads_batch=1, mmproj=str(cached_tiny_projector(**PROJECTOR)),
                                 media_encoders=args.encoders,
                                 kv_layout="per_slot", steady_decode=True)
    _, engine = loader.load_engine(cached_tiny_llama(), config)
    engine.runner.overlaps = True
    for projector in engine.media.projectors:
        projector.encode = slowed(projector.encode, args.encode_ms / 1000)
    try:
        recorder = Recorder(engine, calls)
        done, errors = threading.Semaphore(0), []

        first: dict[int, int] = {}  # each request's first text: the steps run by then

        def sink(i: int, event: Any) -> None:
            if isinstance(event, TextEvent):
                first.setdefault(i, len(recorder.steps))
            if isinstance(event, ErrorEvent):
                errors.append(event)
            if isinstance(event, (FinishEvent, ErrorEvent)):
                done.release()

        prompts = [engine.media.prompt(PROMPT, [MediaInput("image", png(64, 64, seed + i), "image/png")])
                   for i in range(clients)]
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.submit(Request(prompt.tokens, SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                                                                temperature=0.0),
                                  lambda event, i=i: sink(i, event), media=prompt.spans))
            time.sleep(args.gap_ms / 1000)
        for _ in prompts:
            assert done.acquire(timeout=120), "the image requests did not finish"
        assert not errors, errors
        recorder.steps[0]["round"] = {"wall_ms": round(1000 * (time.perf_counter() - start), 1),
                                      "first_token_steps": [first[i] for i in range(clients)]}
        engine.stop()
        for slot in engine.scheduler.slots:  # every slot's KV exactly its tokens (filler rows' writes dropped)
            assert engine.runner.ctx.memory.seq_pos_max(slot.index) + 1 == len(slot.tokens), slot.index
        counts = getattr(engine.runner, "ubatches", None)  # the engine's own count (a tree before 412dc2a has none)
        assert counts is None or counts.step.ubatches + counts.media.ubatches == sum(s["ubatches"] for s in recorder.steps)
        return recorder.steps
    finally:
        engine.stop()
        engine.close()
        loader.step_chunks = chunks  # type: ignore[assignment]


class ForeignCalls:
    """Counts the GIL-releasing foreign calls (ctypes functions of llama.cpp's and the native
    library, looked up as module attributes where called) the engine thread makes, by name: on a
    busy process each one waits up to the switch interval (5 ms) to take the GIL back. Calls bound
    holding the GIL (llama/held.py) are not among them."""

    def __init__(self) -> None:
        import ctypes

        import llama_cpp.llama_cpp as C

        from pflash_plugin.llama import native

        self.thread = 0  # the engine thread's ident, set at its first launch
        self.counts: Counter[str] = Counter()
        lib = native.load()
        for owner in (C, lib) if lib is not None else (C,):
            for name in [n for n in dir(owner) if n.startswith(("llama_", "pfx_"))]:
                function = getattr(owner, name)
                if isinstance(function, ctypes._CFuncPtr):
                    setattr(owner, name, self._counted(name, function))

    def _counted(self, name: str, function: Any) -> Any:
        def call(*args: Any) -> Any:
            if threading.get_ident() == self.thread:
                self.counts[name] += 1
            return function(*args)
        return call

    def take(self) -> dict[str, int]:
        """The counts since the last take."""
        out, self.counts = dict(self.counts), Counter()
        return out


def busy() -> None:
    """Python in 2 ms bursts, for ever: the GIL's other holder (the event loop streaming the
    answers and the preparation threads do this over HTTP; bench/first_token.py --busy)."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.002:
            sum(range(1000))
        time.sleep(0.0002)


def slowed(encode: Any, seconds: float) -> Any:
    """`encode`, `seconds` longer (the GIL released meanwhile, as a GPU encode's wait is)."""
    def slow(chunk: Any) -> Any:
        time.sleep(seconds)
        return encode(chunk)
    return slow


def kind(step: dict[str, Any]) -> str:
    """A step's kind: media pieces in it, text chunks beside decode rows, or decode rows alone."""
    if step["media_pieces"]:
        return "media"
    if step["text_chunks"]:
        return "text+decode" if step["decode_rows"] else "text"
    return "decode"


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step: how many, their ubatches and graph reuse, the decode steps' median round
    and its host part (the round less the decode calls); the round's totals."""
    out: dict[str, Any] = {"steps": len(steps), "ubatches": sum(s["ubatches"] for s in steps),
                           "reused": sum(s["reused"] for s in steps)}
    timed = [s for s in steps if kind(s) == "decode" and "round_ms" in s]
    if timed:
        out["decode_round_ms"] = statistics.median(s["round_ms"] for s in timed)
        out["decode_host_ms"] = round(statistics.median(s["round_ms"] - s["decode_ms"] for s in timed), 3)
        if "foreign_calls" in timed[0]:
            out["decode_foreign_calls"] = statistics.median(sum(s["foreign_calls"].values()) for s in timed)
    for name in ("decode", "text+decode", "text", "media"):
        group = [s for s in steps if kind(s) == name]
        if group:
            n = sum(s["ubatches"] for s in group)
            out[name] = {"steps": len(group), "ubatches_per_step": round(n / len(group), 2),
                         "max_ubatches": max(s["ubatches"] for s in group),
                         "graphs_built_per_step": round((n - sum(s["reused"] for s in group)) / len(group), 2),
                         "rows_per_step": round(sum(s["decode_rows"] + sum(s["text_chunks"]) + sum(s["media_pieces"])
                                                    for s in group) / len(group), 1)}
    out["graphs_built"] = out["ubatches"] - out["reused"]
    firsts = steps[0]["round"]["first_token_steps"]
    out.update(wall_ms=steps[0]["round"]["wall_ms"], mean_first_token_step=round(statistics.mean(firsts), 1),
               last_first_token_step=max(firsts))
    return out


def compare_trees(args: argparse.Namespace) -> None:
    """Each rep and client count on every tree, one child process each (the same flags), in turn."""
    trees = [("head", str(Path(__file__).resolve().parent.parent))] + [t.split("=", 1) for t in args.trees]
    argv = [f"--{key}={getattr(args, key)}" for key in ("max_tokens", "gap_ms", "encode_ms", "encoders", "n_ubatch")]
    argv += [f"--{flag}" for flag in ("calls", "busy") if getattr(args, flag)]
    rows = []
    for rep in range(args.reps):
        for clients in args.clients:
            for name, tree in trees if rep % 2 == 0 else trees[::-1]:
                env = {**os.environ, "VISION_STEPS_TREE": tree}
                done = subprocess.run([sys.executable, __file__, *argv, "--clients", str(clients)], env=env,
                                      capture_output=True, text=True, check=True, timeout=600)
                line = done.stdout.strip().splitlines()[-1]
                rows.append({"tree": name, "clients": clients, "rep": rep, **json.loads(line[line.index("{"):])})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"bench": "vision_steps", "argv": sys.argv[1:], "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max_tokens", type=int, default=64, help="each answer's tokens (bench/vision.py real: 64)")
    ap.add_argument("--gap_ms", type=float, default=2.0, help="between submissions (HTTP preparation's spread)")
    ap.add_argument("--encode_ms", type=float, default=0.0, help="each encode this much longer (a GPU's: ~20)")
    ap.add_argument("--encoders", type=int, default=1, help="--media_encoders (the GPU's default: 4)")
    ap.add_argument("--n_ubatch", type=int, default=512)
    ap.add_argument("--calls", action="store_true", help="count the engine thread's GIL-releasing foreign calls")
    ap.add_argument("--busy", action="store_true", help="a thread beside runs Python (the GIL's other holder)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--steps", action="store_true", help="print every step's row")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trees", nargs="*", default=[], metavar="NAME=PATH",
                    help="this tree (head) and each checkout (a commit's `git archive`, its native library copied "
                         "in) in child processes, interleaved per rep: summaries only")
    args = ap.parse_args()
    if args.trees:
        return compare_trees(args)
    result: dict[str, Any] = {"bench": "vision_steps", "args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    calls = ForeignCalls() if args.calls else None
    if args.busy:
        threading.Thread(target=busy, daemon=True).start()
    for clients in args.clients:
        for rep in range(args.reps):
            steps = workload(args, clients, 1000 * rep, calls)
            result["runs"].append({"clients": clients, "rep": rep, "summary": summary(steps), "steps": steps})
            print(f"clients {clients} rep {rep}: {json.dumps(summary(steps))}", flush=True)
            if args.steps:
                for i, step in enumerate(steps):
                    print(i, kind(step), json.dumps({k: v for k, v in step.items() if k != "slots"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

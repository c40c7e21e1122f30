"""Parity of the batched engine with llama.cpp's own media path, on the GPU (issue 46's target: for
the same GGUF pair and image, the greedy tokens and the logits after the image prompt match
libmtmd's mtmd_helper_eval_chunks within float tolerance; tests/test_media_engine.py checks it on
the CPU only).

For each tiny projector kind (pflash_plugin.llama.tiny_projector: a LLaVA `mlp`, Gemma 3's
non-causal `gemma3`, Qwen2-VL's M-RoPE `qwen2vl`, and the audio `qwen2a`), on its tiny text model:
the engine, with `--n_gpu_layers` layers on the GPU and the projector there too (as the server
loads them), answers the media request greedily beside a text request (the media decoded in
pieces between the text row's steps, as in the tests), every token's top-k logprobs kept; then
llama.cpp's own path on a one-sequence context of the same model and a libmtmd context of the
same projector (pflash_plugin.testing.mtmd_reference, the tests' copy) gives the greedy tokens
and every step's log-softmax. Reported per kind: tokens equal (or where they part, and whether at
a near tie), the max |difference| of the first token's top-k logprobs and of every step's up to
a divergence. The text request beside gets the same comparison against the plain context: the
device's noise floor for the batched engine with no media at all.

Tolerance (`--tolerance`; default 1e-5 on the CPU, 1e-3 with GPU layers): on the CPU both paths
run the same kernels and differ by float32 summation order only (measured 4e-8 at most). On CUDA
the engine's rows and the reference's single token take different kernels (matrix-vector for one
row; batched GEMM and other flash-attention kernels for several), some with F16 intermediates
(2^-11 relative) on the tiny model's logits of spread ~4: the text arm measures that floor. The
bound must stay under what a real fault moves: decoding Gemma 3's image causally moves the first
logprobs by 1.9e-3 (measured on the CPU), M-RoPE text at its index instead of its position 4e-4
to 6e-3 (the tiny model's attention is nearly uniform). A divergence of greedy tokens passes only
as a near tie: the reference's two candidates within twice the tolerance (the tiny model's top
two can be 5e-3 apart). Exit status 1 when any arm is off; a text arm off too says the floor, not
the media path, is above the bound.

    PYTHONPATH=. python bench/gpu/media_parity.py --n_gpu_layers 0 --out /tmp/media_parity.json   # the CPU, seconds

On the H200, a line of bench/gpu/queue.sh's queue after `bench/gpu/mtmd_from_build.py` (libmtmd
into the wheel; servers.sh's --target, --drafter and --llama-server are taken and not used: the
pair is the tiny generated one):
    bench/gpu/media_parity.py --n_gpu_layers -1 --out /tmp/queue/media_parity_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp  # noqa: F401, I001  before numpy: numpy first made the CUDA model load segfault on the H200 machine

from pflash_plugin.engine.engine import Engine
from pflash_plugin.engine.loader import EngineConfig, build_engine, load_model
from pflash_plugin.engine.media import MEDIA_MARKER, MediaInput
from pflash_plugin.engine.request import ErrorEvent, FinishEvent, Request, SamplingParams, TextEvent, TokenOutput
from pflash_plugin.llama import ModelParams
from pflash_plugin.llama.devices import gpu_count
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector
from pflash_plugin.testing.media_files import ppm, wav
from pflash_plugin.testing.mtmd_reference import compare, mtmd_reference

REPO = Path(__file__).resolve().parents[2]
PROMPT = f"<s><|im_start|>user\nlook at {MEDIA_MARKER} the picture and tell<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<s><|im_start|>user\nthe water by the house is<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Case:
    """One projector kind on its tiny text model, with the tests' media and batch sizes."""

    media: MediaInput
    n_batch: int  # the engine's and the reference's (smaller than the media: decoded in pieces)
    prefill_chunk: int
    model: dict[str, Any] = field(default_factory=dict)  # cached_tiny_llama's keywords


CASES = {
    "mlp": Case(MediaInput("image", ppm(1), "image/x-portable-pixmap"), 24, 24),
    "gemma3": Case(MediaInput("image", ppm(1), "image/x-portable-pixmap"), 24, 8),  # 16 tokens, decoded whole
    "qwen2vl": Case(MediaInput("image", ppm(1, 80, 48), "image/x-portable-pixmap"), 8, 8, {"arch": "qwen2vl"}),
    "qwen2a": Case(MediaInput("audio", wav(8000), "audio/wav"), 128, 128),  # 750 tokens
}


def run_engine(engine: Engine, requests: list[Request], timeout_s: float) -> dict[int, list[TokenOutput] | ErrorEvent]:
    """Submits `requests` together; each one's TokenOutputs, or its ErrorEvent, by request id."""
    outputs: dict[int, list[TokenOutput] | ErrorEvent] = {r.request_id: [] for r in requests}
    done = threading.Semaphore(0)
    for request in requests:
        def sink(event: object, rid: int = request.request_id) -> None:
            got = outputs[rid]
            if isinstance(event, TextEvent) and isinstance(got, list):
                got.extend(event.tokens)
            elif isinstance(event, ErrorEvent):
                outputs[rid] = event
            if isinstance(event, (FinishEvent, ErrorEvent)):
                done.release()
        request.sink = sink
    engine.submit(*requests)
    for _ in requests:
        if not done.acquire(timeout=timeout_s):
            raise TimeoutError(f"the engine did not finish within {timeout_s} s")
    return outputs


def one(kind: str, case: Case, args: argparse.Namespace, tolerance: float) -> dict[str, Any]:
    """The engine's answers for the kind's media request and a text request beside it, each
    compared with llama.cpp's own path."""
    projector = str(cached_tiny_projector(kind=kind))
    config = EngineConfig(n_slots=2, max_ctx=1024, n_batch=case.n_batch, n_ubatch=case.n_batch,
                          n_threads=args.threads, n_threads_batch=args.threads, mmproj=projector,
                          prefill_chunk=case.prefill_chunk, model=ModelParams(n_gpu_layers=args.n_gpu_layers))
    model = load_model(cached_tiny_llama(**case.model), config)
    start = time.perf_counter()
    try:
        engine = build_engine(model, config, "parity")
        try:
            asked = {}
            for arm, text, media in (("media", PROMPT, [case.media]), ("text", TEXT, [])):
                prompt = engine.media.prompt(text, media)
                params = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=args.top_k)
                asked[arm] = (text, media, Request(prompt.tokens, params, media=prompt.spans))
            outputs = run_engine(engine, [request for _, _, request in asked.values()], args.timeout_s)
        finally:
            engine.stop()
            engine.close()
        row: dict[str, Any] = {"kind": kind, "prompt_tokens": len(asked["media"][2].prompt_tokens)}
        for arm, (text, media, request) in asked.items():
            got = outputs[request.request_id]
            if isinstance(got, ErrorEvent):
                row[arm] = {"error": got.message, "ok": False}
                continue
            reference = mtmd_reference(model, projector, text, [(m.kind, m.data) for m in media], len(got),
                                       n_batch=case.n_batch, n_threads=args.threads)
            parity = compare(reference, got, tolerance)
            row[arm] = {**asdict(parity), "ok": parity.ok, "tokens": [o.token for o in got],
                        "reference": reference.tokens}
        row["seconds"] = round(time.perf_counter() - start, 3)
        return row
    finally:
        model.close()


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["kind     arm    ok     tokens  diverged  max|d| first  max|d| all  tolerance"]
    for row in rows:
        for arm in ("media", "text"):
            r = row[arm]
            if "error" in r:
                lines.append(f"{row['kind']:<8} {arm:<6} False  error: {r['error']}")
                continue
            tokens = "equal" if r["tokens_equal"] else ("tie" if r["near_tie"] else "DIFFER")
            lines.append(f"{row['kind']:<8} {arm:<6} {str(r['ok']):<6} {tokens:<7} {str(r['diverged_at']):<9} "
                         f"{r['max_abs_first']:<13.3g} {r['max_abs']:<11.3g} {r['tolerance']:.0e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--n_gpu_layers", type=int, default=-1, help="the model's (the projector follows it)")
    parser.add_argument("--tokens", type=int, default=12, help="greedy tokens compared per request")
    parser.add_argument("--top_k", type=int, default=10, help="top logprobs compared per token")
    parser.add_argument("--tolerance", type=float, help="max |logprob difference| (default: 1e-5 CPU, 1e-3 GPU)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout_s", type=float, default=120)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "media_parity.json")
    for ignored in ("--target", "--drafter", "--llama-server"):  # bench/gpu/servers.sh's, not used
        parser.add_argument(ignored, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    on_gpu = args.n_gpu_layers != 0 and gpu_count() > 0
    tolerance = args.tolerance if args.tolerance is not None else (1e-3 if on_gpu else 1e-5)
    rows = [one(kind, CASES[kind], args, tolerance) for kind in args.kinds]
    ok = all(row[arm]["ok"] for row in rows for arm in ("media", "text"))
    tree = os.environ.get("PFLASH_TREE") or subprocess.run(  # the device's copy has no git: queue.sh passes it
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"ok": ok, "on_gpu": on_gpu, "n_gpu_layers": args.n_gpu_layers, "tolerance": tolerance,
              "tokens": args.tokens, "top_k": args.top_k, "tree": tree, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(rows))
    print(f"{'parity' if ok else 'MISMATCH beyond tolerance'} ({'GPU' if on_gpu else 'CPU'}); {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

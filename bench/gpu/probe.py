"""On the CUDA machine: does a generated GGUF load with all layers on the GPU, and does the
drafter reserve formula cover the drafter's measured GPU memory peak?

bash .gpu/on-device.sh && export PYTHONPATH=/tmp/site:$PWD && python bench/gpu/probe.py $OUT
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

LOAD = r"""
import sys
from pflash_plugin.llama import Model, Context, ContextConfig, Batch
m = Model(sys.argv[1], n_gpu_layers=999)
ctx = Context(m, ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64))
b = Batch(64); b.add_sequence(m.tokenize("hello world, this is a test")[:16], 0, 0, True); ctx.decode(b)
print("ok", float(ctx.logits(b.n_tokens - 1).max()))
"""


def load_check(out: Path) -> dict:
    from pflash_plugin.testing import write_tiny_llama

    results = {}
    for name, kw in {"default_f32": {}, "f16": {"f16": True}, "embd256_f16": {"f16": True, "n_embd": 256, "n_ff": 512}}.items():
        path = write_tiny_llama(out / f"{name}.gguf", **kw)
        run = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True, timeout=120)
        results[name] = {"rc": run.returncode, "stdout": run.stdout.strip()[-200:], "stderr": run.stderr.strip()[-1500:]}
        path.unlink()
    return results


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def gpu_peak(fn) -> tuple[object, int]:
    """Device-wide used-memory peak (bytes) while fn runs, sampled by nvidia-smi every 10 ms.
    Not torch: torch and ggml-cuda abort or segfault when loaded in one process (either order)."""
    base = gpu_used_mib()
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "10"],
                               stdout=subprocess.PIPE, text=True)
    try:
        result = fn()
        time.sleep(0.05)
    finally:
        sampler.terminate()
    peak = max([base] + [int(line) for line in sampler.stdout.read().split() if line.isdigit()])
    return result, (peak - base) * 2**20


def reserve_check(out: Path) -> list[dict]:
    from pflash_plugin.llama import Model
    from pflash_plugin.pflash.compressor import CompressionJob, Compressor, PflashConfig
    from pflash_plugin.pflash.drafter import DraftOptions, Drafter, scoring_layers
    from pflash_plugin.pflash.query import plan_query
    from pflash_plugin.pflash.reserve import drafter_reserve
    path = out / "medium.gguf"
    # written by another process: on the CUDA build, loading a GGUF in the process that wrote it
    # with the gguf package segfaulted inside llama_model_load_from_file (seen for every shape)
    subprocess.run([sys.executable, "-c", "import sys; from pflash_plugin.testing import write_tiny_llama; "
                    "write_tiny_llama(sys.argv[1], n_layer=12, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, "
                    "n_ctx_train=65536, f16=True)", str(path)], check=True)
    model = Model(path, n_gpu_layers=999)
    layers = scoring_layers(model, None)
    rows = []
    for n in (2048, 8192, 32768):
        tokens = (model.tokenize("the river and the bridge. " * (n // 4)) * 2)[:n]
        compressor = Compressor(PflashConfig(), model.piece, lambda: Drafter(model, layers, n, DraftOptions(n_batch=512)), persistent=False)
        t0 = time.perf_counter()
        result, peak = gpu_peak(lambda: compressor.compress(CompressionJob(tokens, plan_query(len(tokens), 8), 0.2)))
        formula = drafter_reserve(model, layers, 512, separate_weights=False).bytes_for(n)
        rows.append({"tokens": n, "gpu_peak": peak, "formula": formula, "covered": peak <= formula,
                     "status": result.report.status, "seconds": round(time.perf_counter() - t0, 3),
                     "kv_bytes_per_token": model.kv_bytes_per_token()})
        print(json.dumps(rows[-1]), flush=True)
    path.unlink()
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    report = {"load": load_check(out)}
    print(json.dumps(report["load"], indent=1), flush=True)
    report["reserve"] = reserve_check(out)
    (out / "gpu_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

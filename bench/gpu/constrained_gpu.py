"""Structured output at 64 clients on a GPU: json_schema rows (a three-field object, a larger order)
against plain rows, llguidance (and, with `--arms llama llguidance`, llama.cpp's grammar sampler),
bench/constrained.py's trial with GPU defaults. Target (issue 49): schema rows >= 0.9x plain rows'
tokens/s on the H200.

On the CUDA machine, with the 128K-vocabulary models (bench/gpu/setup.sh), llama-server not needed:
    NO_LLAMA_SERVER=1 VOCAB_EXTRA=127000 bash bench/gpu/servers.sh bench/gpu/constrained_gpu.py \\
        --out $OUT/constrained_gpu.json
On a CPU, tiny shapes (a check of the script):
    python bench/gpu/constrained_gpu.py --target TINY.gguf --drafter x --llama-server none \\
        --gpu-layers 0 --clients 4 --slots 4 --max-tokens 16 --reps 1 --out /tmp/constrained_gpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import constrained  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", help="(servers.sh passes it; not used)")
    parser.add_argument("--llama-server", dest="llama_server", help="(servers.sh passes it; not used)")
    parser.add_argument("--arms", nargs="+", default=["llguidance"], choices=["llama", "llguidance"])
    parser.add_argument("--kinds", nargs="+", default=list(constrained.KINDS), choices=list(constrained.KINDS))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu-layers", dest="gpu_layers", type=int, default=-1)
    parser.add_argument("--baseline", help="also llguidance on this git revision's code (before/after in one run)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run_args = constrained.parser().parse_args([])
    for key in ("arms", "kinds", "clients", "slots", "max_tokens", "reps", "gpu_layers", "baseline"):
        setattr(run_args, key, getattr(args, key))
    # ours' --n_ctx is one slot's context (the KV pool holds slots x n_ctx): a slot's prompt and answer.
    # slots x (max_tokens + 64) here made each server's pool 786K tokens and the second one failed to start
    run_args.model, run_args.n_ctx = args.target, 1024 + args.max_tokens
    result = constrained.run(run_args)
    ratios = {f"{arm}/{kind}": round(result["medians"][f"{arm}/{kind}"]["tok_s"]
                                     / result["medians"][f"{arm}/plain"]["tok_s"], 3)
              for arm in sorted({key.split("/")[0] for key in result["medians"]})
              for kind in args.kinds if kind != "plain" and "plain" in args.kinds}
    result["schema_over_plain"] = ratios
    # per engine step (decode ms/step, plain's over the schema rows'): person rows end at ~40 tokens, plain at 128
    result["schema_over_plain_by_step"] = by_step(result["medians"], ratios, "step_ms")
    # the same from the moment every client had its first text: the decode alone, arrivals and prefills left out
    result["schema_over_plain_by_decode_step"] = by_step(result["medians"], ratios, "decode_step_ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(constrained.table(result))
    print(json.dumps({"tok_s": ratios, "by_step": result["schema_over_plain_by_step"],
                      "by_decode_step": result["schema_over_plain_by_decode_step"]}))


def by_step(medians: dict, kinds: dict, key: str) -> dict[str, float]:
    """Plain rows' `key` (ms a step) over each schema kind's, where both have it."""
    out = {}
    for name in kinds:
        plain, schema = medians[name.split("/")[0] + "/plain"].get(key), medians[name].get(key)
        if plain and schema:
            out[name] = round(plain / schema, 3)
    return out


if __name__ == "__main__":
    main()

"""Structured output at 64 clients on a GPU: json_schema rows (a three-field object, a larger order)
against plain rows, llguidance (and, with `--arms llama llguidance`, llama.cpp's grammar sampler;
with `llama-server`, llama.cpp's server on the same schema, its grammar sampler), bench/constrained.py's
trial with GPU defaults. Target (issue 49): schema rows >= 0.9x plain rows' tokens/s on the H200.

Person rows end at ~40 tokens, plain rows at 128: `plain_as_person` rows (in the default kinds) are
plain rows each as long as the same client's person row, the comparison of equal answer lengths and
equal churn (`schema_over_same_lengths`). `--engine-steps` then times each engine step in this
process (bench/constrained_steps.py: which steps rebuilt llama.cpp's graph as rows ended, and what
they cost), after the servers have stopped.

On the CUDA machine, with the 128K-vocabulary models (bench/gpu/setup.sh):
    VOCAB_EXTRA=127000 bash bench/gpu/servers.sh bench/gpu/constrained_gpu.py --arms llguidance llama-server \\
        --ours-arms unsteady=--steady_decode,off --engine-steps --out $OUT/constrained_gpu.json
On a CPU, tiny shapes (a check of the script; the llama-server arm is skipped without a binary):
    python bench/gpu/constrained_gpu.py --target TINY.gguf --drafter x --llama-server none \\
        --gpu-layers 0 --clients 4 --slots 4 --max-tokens 16 --reps 1 --engine-steps --out /tmp/constrained_gpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import constrained  # noqa: E402
import constrained_steps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", help="(servers.sh passes it; not used)")
    parser.add_argument("--llama-server", dest="llama_server", help="llama-server's binary (the llama-server arm)")
    parser.add_argument("--arms", nargs="+", default=["llguidance"], choices=["llama", "llguidance", "llama-server"])
    parser.add_argument("--ours-arms", dest="ours_arms", nargs="*", default=[], metavar="NAME=FLAGS",
                        help="more arms: llguidance with these server flags (ENV:KEY=VALUE: its environment), e.g. "
                             "unsteady=--steady_decode,off")
    parser.add_argument("--kinds", nargs="+", default=list(constrained.KINDS), choices=list(constrained.KINDS))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu-layers", dest="gpu_layers", type=int, default=-1)
    parser.add_argument("--baseline", help="also llguidance on this git revision's code (before/after in one run)")
    parser.add_argument("--engine-steps", dest="engine_steps", action="store_true",
                        help="then each engine step timed in this process (bench/constrained_steps.py)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run_args = constrained.parser().parse_args([])
    for key in ("arms", "ours_arms", "kinds", "clients", "slots", "max_tokens", "reps", "gpu_layers", "baseline",
                "llama_server"):
        setattr(run_args, key, getattr(args, key))
    # ours' --n_ctx is one slot's context (the KV pool holds slots x n_ctx): a slot's prompt and answer.
    # slots x (max_tokens + 64) here made each server's pool 786K tokens and the second one failed to start
    run_args.model, run_args.n_ctx = args.target, 1024 + args.max_tokens
    result = constrained.run(run_args)
    medians = result["medians"]
    arms = sorted({key.split("/")[0] for key in medians})
    schema_kinds = [kind for kind in args.kinds if constrained.KINDS[kind] is not None]
    result["schema_over_plain"] = over(medians, arms, schema_kinds, lambda kind: "plain", "tok_s")
    # per engine step (decode ms/step, plain's over the schema rows'): person rows end at ~40 tokens, plain at 128
    result["schema_over_plain_by_step"] = over(medians, arms, schema_kinds, lambda kind: "plain", "step_ms")
    # the same from the moment every client had its first text: the decode alone, arrivals and prefills left out
    result["schema_over_plain_by_decode_step"] = over(medians, arms, schema_kinds, lambda kind: "plain",
                                                      "decode_step_ms")
    # against plain rows of the same answer lengths (constrained.SAME_LENGTHS): the fair comparison
    same = {source: kind for kind, source in constrained.SAME_LENGTHS.items() if kind in args.kinds}
    twins = [kind for kind in schema_kinds if kind in same]
    result["schema_over_same_lengths"] = over(medians, arms, twins, same.__getitem__, "tok_s")
    result["schema_over_same_lengths_by_decode_step"] = over(medians, arms, twins, same.__getitem__, "decode_step_ms")
    if "llama-server" in arms:  # ours' tokens/s over llama-server's, kind by kind
        result["over_llama_server"] = {f"{arm}/{kind}": round(medians[f"{arm}/{kind}"]["tok_s"]
                                                              / medians[f"llama-server/{kind}"]["tok_s"], 3)
                                       for arm in arms if arm != "llama-server" for kind in args.kinds}
    if args.engine_steps:
        result["engine_steps"] = engine_steps(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(constrained.table(result))
    if args.engine_steps:
        print(constrained_steps.table(result["engine_steps"]))
    print(json.dumps({key: result[key] for key in result if key.startswith(("schema_over", "over_"))}))


def engine_steps(args: argparse.Namespace) -> dict:
    """bench/constrained_steps.py on the target: person, plain_as_person and plain rows, each step timed."""
    step_args = constrained_steps.parser().parse_args([
        "--model", args.target, "--clients", str(args.clients), "--max-tokens", str(args.max_tokens),
        "--reps", str(args.reps), "--gpu-layers", str(args.gpu_layers)])
    return constrained_steps.run(step_args)


def over(medians: dict, arms: list[str], kinds: list[str], base, key: str) -> dict[str, float]:
    """Each kind's `key` against its base kind's on the same arm, where both have it: tokens/s
    (kind over base), or ms a step (base over kind: a speed, >1 faster than the base)."""
    out = {}
    for arm in arms:
        for kind in kinds:
            mine, theirs = medians.get(f"{arm}/{kind}", {}).get(key), medians.get(f"{arm}/{base(kind)}", {}).get(key)
            if mine and theirs:
                out[f"{arm}/{kind}"] = round(mine / theirs if key == "tok_s" else theirs / mine, 3)
    return out


if __name__ == "__main__":
    main()

"""Step by step: what each engine step of bench/constrained.py's trials costs, in this process
(issue 49 part 5: person rows' decode steps cost ~2x order rows' on the H200 with the same
constraint phases).

Person rows end at ~40 tokens, each at its own step, so for the last ~15 steps nearly every step has
fewer rows than the one before: llama.cpp rebuilds its graph for another token count
(llm_graph_params::allow_reuse), and on a GPU ggml-cuda runs a changed graph kernel by kernel and
captures it again on the next call of the same shape (docs/speculation.md, "Why a rare probe cost so
much"). Plain rows at 128 tokens all end at the same step and never pay that; order rows neither.
This bench times each step and says which steps rebuilt the graph, for three kinds of 64 rows:
`person` (the schema), `plain_as_person` (plain rows, each as long as the same client's person
row: the same rows ending at the same steps, no constraint) and `plain` (all of --max-tokens).
Per trial: tokens/s, and each decode step's time (from one step's start to the next's: the round,
scheduling and events included) grouped by steps since llama.cpp last rebuilt the graph (0: this
step rebuilt it; 1: the next, a CUDA graph's capture on a GPU; 2+: settled), and the excess of all
decode steps over the settled median (ms a step): what the changing shape costs. Also each decode
step's runs of consecutive slots: with a KV stream per slot llama.cpp decodes each run as a ubatch of
its own (llama_batch_allocr::split_equal, `sequential`), each reading all the weights. `--steady off
on` runs every trial with the engine's steady decode steps off and on (engine/steps.py: filler rows
keep a decode step's slots one run, and its shape while rows end; on by default on a GPU).

    python bench/constrained_steps.py --model TINY.gguf --clients 64 --reps 2     # the CPU
    bench/gpu/constrained_gpu.py ... --engine-steps                              # the H200, after the HTTP trials
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import constrained  # noqa: E402
from harness import run_to_end  # noqa: E402

KINDS = ("person", "plain_as_person", "plain")
# decode steps by steps since the graph was last rebuilt: 0, 1, and 2 or more (steady)
AGES = ("rebuilt", "next", "settled")


def requests(model: Any, kind: str, clients: int, max_tokens: int, rep: int, lengths: list[int] | None) -> list[Any]:
    """bench/constrained.py's trial as engine requests: its prompts, seeds and temperature; the schema
    compiled and its matcher built as the server's route does (compile_schema, check_constraint)."""
    from pflash_plugin.engine.constraints import check_constraint, compile_schema
    from pflash_plugin.engine.request import Request, SamplingParams

    schema = constrained.KINDS[kind]
    grammar = compile_schema(schema) if schema is not None else None
    out = []
    for i in range(clients):
        prompt = model.tokenize(f"Record {rep}.{i} of the shop's database, as JSON:".encode(), add_special=True,
                                parse_special=False)
        wanted = lengths[i] if lengths else max_tokens
        params: dict[str, Any] = {"max_tokens": wanted, "temperature": 0.8, "seed": 1000 * (rep + 1) + i}
        if grammar is not None:
            check_constraint(model, grammar)
            params["constraint"] = grammar
        else:
            params["min_tokens"] = wanted
        out.append(Request(prompt, SamplingParams(**params)))
    return out


class StepClock:
    """Each step the engine runs: its rows, its tokens, when it started and whether llama.cpp
    reused the graph before it (Context.graph_reuses)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.ctx = engine, engine.runner.ctx
        self.steps: list[tuple[int, int, float, float, int, int]] = []  # rows, tokens, start, seconds, reused, runs
        self._run = engine.stepping.run
        engine.stepping.run = self._timed

    def _timed(self, step: Any) -> None:
        reused, start = self.ctx.graph_reuses(), time.perf_counter()
        self._run(step)
        slots = sorted(item.request.held_slot for item in step.items)
        runs = 1 + sum(b != a + 1 for a, b in zip(slots, slots[1:]))
        self.steps.append((len(step.items), step.n_tokens, start, time.perf_counter() - start,
                           self.ctx.graph_reuses() - reused, runs))

    def summary(self) -> dict[str, Any]:
        """Decode steps (one token a row) by steps since the last rebuild, and their excess over the steady median."""
        steps = self.steps
        ends = [steps[k + 1][2] for k in range(len(steps) - 1)] + [steps[-1][2] + steps[-1][3]]
        ages: dict[str, list[float]] = {name: [] for name in AGES}
        out: dict[str, Any] = {}
        age, decode = 2, []
        runs = []
        for (rows, tokens, start, _, reused, run), end in zip(steps, ends):
            age = 0 if not reused else age + 1
            if rows == tokens:
                ms = 1000 * (end - start)
                decode.append(ms)
                runs.append(run)
                ages[AGES[min(age, 2)]].append(ms)
        for name, found in ages.items():
            out[f"{name}_steps"] = len(found)
            out[f"{name}_ms"] = round(statistics.median(found), 2) if found else None
        settled = out["settled_ms"] or (statistics.median(decode) if decode else 0.0)
        out["decode_steps"] = len(decode)
        out["decode_step_ms"] = round(statistics.mean(decode), 2) if decode else None
        out["excess_ms_per_step"] = round(sum(ms - settled for ms in decode) / len(decode), 2) if decode else None
        out["runs_per_step"] = round(statistics.mean(runs), 2) if runs else None
        out["graph_reused_share"] = round(sum(s[4] > 0 for s in steps) / len(steps), 3)
        out["rows"] = [s[0] for s in steps]
        out["step_ms"] = [round(1000 * (end - s[2]), 2) for s, end in zip(steps, ends)]
        out["reused"] = [int(s[4] > 0) for s in steps]
        out["runs"] = [s[5] for s in steps]
        return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each rep, with the engine's steady decode steps off and on in turn (`--steady`: engine/steps.py's
    filler rows): person, then plain_as_person with its lengths, then plain, one engine in this process."""
    from pflash_plugin.engine.loader import EngineConfig, load_engine
    from pflash_plugin.llama import ModelParams

    config = EngineConfig(n_slots=args.clients, max_ctx=1024 + args.max_tokens,
                          model=ModelParams(n_gpu_layers=args.gpu_layers))
    model, engine = load_engine(args.model, config)
    clock, trials = StepClock(engine), []
    try:
        for rep, steady in [(rep, steady) for rep in range(-1, args.reps) for steady in args.steady]:
            engine.scheduler.steps.steady = steady == "on"  # rep -1: a warm-up, not kept
            lengths = None
            for kind in args.kinds:
                clock.steps.clear()
                batch = requests(model, kind, args.clients, args.max_tokens, rep,
                                 lengths if kind == "plain_as_person" else None)
                wall = run_to_end(engine, batch, 1800)
                got = [len(r.output_tokens) for r in batch]
                lengths = got if kind == "person" else lengths
                trial = {"kind": f"{kind}/steady={steady}", "rep": rep, "tokens": sum(got), "wall_s": round(wall, 3),
                         "tok_s": round(sum(got) / wall, 1), **clock.summary()}
                if rep >= 0:
                    trials.append(trial)
                print(json.dumps({k: v for k, v in trial.items() if not isinstance(v, list)}), flush=True)
    finally:
        engine.stop()
        engine.close()
        model.close()
    keys = [k for k in trials[0] if k not in ("kind", "rep") and not isinstance(trials[0][k], list)] if trials else []
    medians = {kind: {k: statistics.median(t[k] for t in trials if t["kind"] == kind and t[k] is not None)
                      for k in keys if any(t["kind"] == kind and t[k] is not None for t in trials)}
               for kind in {t["kind"]: None for t in trials}}
    return {"command": " ".join(sys.argv), "clients": args.clients, "max_tokens": args.max_tokens, "reps": args.reps,
            "medians": medians, "trials": trials}


def table(result: dict[str, Any]) -> str:
    lines = ["| rows | tok/s | decode ms/step | rebuilt ms (steps) | next ms (steps) | settled ms (steps) "
             "| excess ms/step | graph reused | slot runs a step |", "|---|" + "---:|" * 8]
    for kind, m in result["medians"].items():
        cells = [_num(m.get("tok_s")), _num(m.get("decode_step_ms")),
                 *(f"{_num(m.get(f'{a}_ms'))} ({_num(m.get(f'{a}_steps'), 0)})" for a in AGES),
                 _num(m.get("excess_ms_per_step")), _num(m.get("graph_reused_share"), 3), _num(m.get("runs_per_step"))]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--gpu-layers", dest="gpu_layers", type=int, default=0)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--steady", nargs="+", default=["off", "on"], choices=["off", "on"],
                   help="the engine's steady decode steps (filler rows), each in turn")
    p.add_argument("--out", type=Path)
    return p


def main() -> None:
    args = parser().parse_args()
    result = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

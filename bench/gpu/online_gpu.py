"""Online serving benchmark on one GPU (issue 48): bench/online.py's method on the random-weight models.

On the CUDA machine (bench/gpu/servers.sh builds llama-server, writes the 128K-vocabulary models):
    VOCAB_EXTRA=127000 bash bench/gpu/servers.sh bench/gpu/online_gpu.py --out $OUT/online_h200.json
(or a line of bench/gpu/queues/online.txt). On a CPU, tiny shapes (a check of the script):
    python bench/gpu/online_gpu.py --target TINY.gguf --drafter TINY.gguf --llama-server none --gpu-layers 0 \\
        --slots 4 --pool 8192 --long 512 2048 --rates 2 4 --window-s 3 --out /tmp/online_tiny.json

Requests: ShareGPT's prompt and answer lengths (bench/data/sharegpt_lengths.json, vLLM's sampling;
answers halved by default, `--output-scale`, so that a run ends within its 20 s drain) as random
token ids, 10% of them long prompts of 4-32K tokens (log-uniform), Poisson arrivals at
each rate, every answer generated to its length (ours `min_tokens`, llama-server `ignore_eos`, the
example server a -100 logit bias on the end-of-generation tokens). Arms, all up at once, driven one
at a time, side by side at each rate: ours (one server, `--pflash auto`; arm `ours` sends
`pflash: {"mode": "off"}` per request, `ours-pflash-auto` nothing), llama-server with and without
`-bs`, llama-cpp-python's example server (bench/upstream.py, its best configuration). Every server
gets the same slots and one KV pool of `--pool` cells. Objective: TTFT <= 1 s and TPOT <= 100 ms.
`--budget-s` bounds the sweep (no run starts after it): the default fits one 9-minute device call
with the setup already done on the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu import VOCAB, Server, log_dir, models_parser  # noqa: E402
from online_data import LENGTHS, Mix, token_items  # noqa: E402  (bench/, on the path through multi_gpu)
from online_load import Objective  # noqa: E402
from online_sweep import Arm, Sweep, eog_tokens, wait_idle  # noqa: E402
from upstream import UpstreamServer, available, model_options  # noqa: E402

OBJECTIVE = Objective(ttft_s=1.0, tpot_s=0.1)
LONG_SHARE = 0.1


def ours(args: argparse.Namespace, label: str = "ours", offset: int = 0, *extra: str) -> Server:
    return Server(label, [
        "--model", args.target, "--n_gpu_layers", str(args.gpu_layers), "--n_ctx", str(args.long[1] + 4096),
        "--kv_pool_tokens", str(args.pool), "--max_concurrency", str(args.slots), "--max_queue", "4096",
        "--n_batch", "2048", "--n_ubatch", "512", "--flash_attn", "true",
        "--pflash", "auto", "--pflash_drafter", args.drafter, *extra,
    ], port=args.port + offset, log_dir=log_dir(args), ours=True)


def peers(args: argparse.Namespace) -> list[tuple[str, Server | UpstreamServer, str]]:
    """llama-server (-bs and not: unified KV, `--cache-ram 0` as decode_scale runs it) and the example server."""
    out: list[tuple[str, Server | UpstreamServer, str]] = []
    if args.llama_server != "none":
        for i, (label, extra) in enumerate((("llama-server", []), ("llama-server-bs", ["-bs"]))):
            out.append((label, Server(label, [
                "-m", args.target, "--host", "127.0.0.1", "-ngl", "999", "-c", str(args.pool), "-np", str(args.slots),
                "-kvu", "-b", "2048", "-ub", "512", "-fa", "on", "--cache-ram", "0", *extra,
            ], program=[args.llama_server], port=args.port + 1 + i, log_dir=log_dir(args)), "ignore_eos"))
    if available():
        options = model_options(args.target, slots=args.slots, n_ctx=args.pool, gpu=args.gpu_layers != 0)
        out.append(("upstream", UpstreamServer("upstream", [], port=args.port + 3, log_dir=log_dir(args),
                                               options=options), "logit_bias"))
    return out


# more servers of ours, each with flags of its own, run only where --arms names them (and their -pflash-auto arms):
# CUDA graphs off; the whole step for a prefill beside decoding answers (2,048: the GPU default before 512,
# loader.step_chunks; its A/B as ours-c512 at d028491, docs/online.md); large requests' preparation held back
# while a first token is a step away or not (--polite_prepare_ms, 100 by default since e20e45d's A/B: ours-eager is
# the server before it; docs/online.md); 1,024 prefill tokens a step beside decoding answers, between the two
# (session 70: at 2 req/s ours' long prompts reached their first token 20-40% after llama-server's, its TTFT p99 above);
# the 512 cap not grown while few answers decode (--prefill_per_answer 0: the default before session 74, whose H200
# A/B of the growth is in docs/online.md); the cap in all a step however many prompts prefill, as on the CPU (on a GPU
# it is per prompt: several long prompts at 512 each cost the answers beside them a 100 ms TPOT, session 74's data)
EXTRA_OURS = {"ours-graphs-off": ("--cuda_graphs", "off"), "ours-whole-step": ("--prefill_chunk", "2048"),
              "ours-eager": ("--polite_prepare_ms", "0"), "ours-c1024": ("--prefill_chunk", "1024"),
              "ours-pa0": ("--prefill_per_answer", "0"), "ours-per-step": ("--prefill_chunk_per_step", "true")}
ON_REQUEST = tuple(label + tail for label in EXTRA_OURS for tail in ("", "-pflash-auto"))


def arms(args: argparse.Namespace) -> list[Arm]:
    eog = eog_tokens(args.target)
    extra = [ours(args, label, 5 + i, *flags) for i, (label, flags) in enumerate(EXTRA_OURS.items())]
    out = []
    for server in (ours(args), *extra):
        out += [Arm(server.label, server, "min_tokens", {"pflash": {"mode": "off"}}),
                Arm(f"{server.label}-pflash-auto", server, "min_tokens")]
    out += [Arm(label, peer, force, eog=eog) for label, peer, force in peers(args)]
    return [arm for arm in out if arm.label in args.arms] if args.arms else \
        [arm for arm in out if arm.label not in ON_REQUEST]


def servers_of(the_arms: list[Arm]) -> list:
    """Each server once (two arms share ours), in the arms' order."""
    return list({id(arm.server): arm.server for arm in the_arms}.values())


def start(the_arms: list[Arm]) -> None:
    """Ours first (its KV pool and drafter reserve are sized against the free memory), then the rest together."""
    servers = servers_of(the_arms)
    servers[0].start(900)
    for server in servers[1:]:
        server.launch()
    for server in servers[1:]:
        server.wait_ready(900)
    for arm in the_arms:
        wait_idle(arm, 300.0)  # a first request: warm


def main() -> None:
    parser = models_parser(__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--arms", nargs="*", help="only these arms (labels)")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--pool", type=int, default=65536, help="KV cells of each server (all its slots together)")
    parser.add_argument("--long", type=int, nargs=2, default=[4096, 32768], help="long prompts' token range")
    parser.add_argument("--output-scale", type=float, default=0.5, help="answers are ShareGPT's lengths times this")
    parser.add_argument("--window-s", type=float, default=8.0, help="each run's arrivals span about this long")
    parser.add_argument("--drain-s", type=float, default=20.0, help="a run's requests are cut this long after its last arrival")
    parser.add_argument("--budget-s", type=float, default=360.0, help="no run starts after this many seconds of sweep")
    parser.add_argument("--gpu-layers", dest="gpu_layers", type=int, default=-1)
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    mix = Mix(long_share=LONG_SHARE, long_low=args.long[0], long_high=args.long[1], output_scale=args.output_scale)
    pairs = json.loads(LENGTHS.read_text())["pairs"]

    def items(rate: float, rep: int, arm: int) -> list:
        return token_items(mix, pairs, max(8, round(rate * args.window_s)), 1000 * rep + int(rate * 100), VOCAB, arm)

    the_arms = arms(args)
    from multi_gpu import machine

    meta = {"bench": "online", "device": "gpu", "machine": machine(), "mix": mix.__dict__, "slots": args.slots,
            "pool": args.pool, "window_s": args.window_s, "drain_s": args.drain_s, "budget_s": args.budget_s,
            "model": f"random-weight 8B-class F16 target ({Path(args.target).name}), drafter {Path(args.drafter).name}"}
    sweep = Sweep(the_arms, args.rates, args.reps, items, OBJECTIVE, lambda last: last + args.drain_s, args.out, meta,
                  budget_s=args.budget_s, settle_s=60.0)
    t0 = time.perf_counter()
    try:
        start(the_arms)
        sweep.meta["startup_s"] = round(time.perf_counter() - t0, 1)
        sweep.run(lambda message: print(message, flush=True))
    finally:
        for server in servers_of(the_arms):
            server.stop()
    print(f"{args.out}: {len(sweep.rows)} runs in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

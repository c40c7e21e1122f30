"""docs/pflash_draft_profile.md from the H200 runs of issue 20 (docs/data/*_h200.json):
the windowed draft's profile before and after the pinned KV view, the pin's A/B, and PFlash over HTTP.

    python bench/gpu/draft_report.py
"""
from __future__ import annotations

import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
DATA = DOCS / "data"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def short(kernel: str) -> str:
    """A readable kernel name: demangled enough to tell the kernels apart."""
    match = re.match(r"_Z(?:N\d+\w+?)?\d+([A-Za-z_]\w*?)(?:I|E|v|P|$)", kernel)
    name = match.group(1) if match else kernel
    return name if len(name) < 60 else name[:57] + "..."


def profile_rows(data: dict, label: str) -> list[str]:
    rows = []
    for arm in ("draft", "plain", "plain-ub2048"):
        summary, trace = data["summary"][arm], data["traces"][arm]
        calls = trace["runtime calls [ms, calls] per ubatch"]
        launches = sum(calls.get(name, [0, 0])[1] for name in ("cudaLaunchKernel_v7000", "cudaLaunchKernelExC_v11060"))
        rows.append(f"| {label} | {arm} | {summary['us_per_token']} | {summary['ms_per_ubatch']:.2f} | "
                    f"{trace['gpu_busy_ms_per_ubatch']:.2f} | {trace['kernels_per_ubatch']:.0f} | {launches:.0f} | "
                    f"{calls.get('cudaGraphLaunch_v10000', [0, 0])[1]:.2f} | "
                    f"{calls.get('cudaStreamSynchronize_v3020', [0, 0])[0]:.2f} |")
    if "floor" in data["summary"]:  # untraced: a model of the same depth with almost no arithmetic
        floor = data["summary"]["floor"]
        rows.append(f"| {label} | floor (tiny widths) | {floor['us_per_token']} | {floor['ms_per_ubatch']:.2f} | | | | | |")
    return rows


def main() -> None:
    before, after = load("draft_profile_h200.json"), load("draft_profile_pinned_h200.json")
    pin, target, http = load("draft_pin_drafter_h200.json"), load("draft_pin_target_h200.json"), load("pflash_http_h200.json")
    lines = [
        "# Where the windowed draft's time goes on an H200, and the pinned KV view",
        "",
        "Issue 20's profile (regenerate this page: `python bench/gpu/draft_report.py`; commands below).",
        "The 0.6B drafter cut to its 10 scoring layers, W 2048 with a 64-token sink, 512-token ubatches, 64K",
        "random tokens. Arms of `bench/gpu/draft_profile.py`: `draft` is the drafter as the server runs it;",
        "`plain` decodes the same windows without the capture callback; `plain-ub2048` a window per ubatch.",
        "µs/token and ms/ubatch are untraced medians; the other columns come from one more run of each arm",
        "traced with CUPTI (`bench/gpu/cupti_trace.c`: Nsight Systems is not on the machine and ncu read",
        "nothing), whose tracing itself slows the host.",
        "",
        "| run | arm | µs/token | ms/ubatch | GPU busy ms/ubatch | kernels/ubatch | kernel launches/ubatch "
        "| CUDA graph launches/ubatch | ms in stream syncs/ubatch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *profile_rows(before, "before (one run)"),
        *profile_rows(after, "pinned (another run)"),
        "",
        "- **The draft was host-bound.** The GPU was busy 1.6 ms of a 5.8 ms ubatch; the host spent the rest",
        "  launching about 300 kernels one by one (cuBLAS's host side alone was 29% of the host's samples",
        "  in py-spy), building the KQ mask (10%), writing the batch in Python (11%). A model of the same",
        "  depth and almost no arithmetic took as long per ubatch as the real one.",
        "- **Why no CUDA graphs:** llama.cpp sized each ubatch's view of the KV (n_kv) by the highest cell in",
        "  use, so a window's 4 ubatches had 4 shapes; llama.cpp then rebuilt the graph for each and the CUDA",
        "  backend never saw the same graph twice. A window in one ubatch (`plain-ub2048`) does get a CUDA",
        "  graph, but its KQ mask, built on the host in time that grows with the square of the ubatch, took",
        "  48% of its host time.",
        "- **The pin** (`Drafter._pin_view`, on by default where the drafter is on a GPU): a cell of a",
        "  sequence no draft uses sits at the last cell a window needs, so every window ubatch has the same",
        "  n_kv; llama.cpp reuses the graph (after the K shift that starts each window it builds it again)",
        "  and the CUDA backend replays it. Kernel launches per ubatch fell from about 270 to 0; the host",
        "  now waits in stream syncs (the capture callback synchronizes at the captured nodes) and still",
        "  spends about 2.3 ms a ubatch outside CUDA calls (mask, inputs, the CPU's token-embedding rows).",
        "  The batch is written as arrays now (0.5 to 0.04 ms for 512 tokens).",
        "",
        "**Next: lanes** (`--pflash_drafter_lanes N`, built, not yet measured on a GPU). With the pin the",
        "host's ~2.3 ms of work a ubatch and the GPU's ~1.7 ms still run one after the other: the capture",
        "callback makes ggml's scheduler wait for the GPU before the host can prepare the next ubatch. Lanes",
        "are N drafter contexts drafting a prompt's windows at once on N threads (each decodes the sink",
        "again and captures into the first one's stores), so that one's host work can overlap another's",
        "GPU work; if they overlap fully, about 2 ms a ubatch, ~4 µs a token. Measure with",
        "`draft_forward.py --configs W2048-ub512 W2048-ub512-l2 W2048-ub512-l3`. On 2 CPU cores (demo",
        "model, 16K, medians of 3) 2 lanes took 356 µs a token against 372: no gain there, as expected.",
        "Their scores equal one context's within 0.001 of the largest mass on llama-architecture test",
        "models; on the demo model (gemma-3) they differ by 0.037, because a lane re-rotates the sink's",
        "last cell (F16 K) fewer times: the effect side by side windows show too (pflash_draft_batching.md).",
        "",
        "Quality gate with 2 lanes (`python bench/pflash_windows.py --lanes 2 --n_threads 2`, the demo model",
        "as its own drafter, 2 CPU cores, windows forced; data: `data/pflash_windows_lanes_cpu.json`):",
        "",
        "| prompt tokens | prompts | retrieved, causal | retrieved, windows in 2 lanes | kept overlap median (min) |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {row['tokens']:,} | {row['prompts']} | {row['causal_retrieved']}/{row['prompts']} | "
          f"{row['windowed_retrieved']}/{row['prompts']} | {row['overlap_median']:.2f} ({row['overlap_min']:.2f}) |"
          for row in load("pflash_windows_lanes_cpu.json")["summary"]],
        "",
        "(One context, docs/pflash_gpu.md: 7/7 and 7/7, overlap 0.80 (0.59) and 0.72 (0.67).)",
        "",
        "## The pin, side by side (`bench/gpu/draft_forward.py`, configurations interleaved, medians of 2)",
        "",
        "| model | configuration | 64K µs/token | 128K µs/token | largest score difference |",
        "|---|---|---:|---:|---:|",
    ]
    for data, model in ((pin, "0.6B drafter, 10 layers"), (target, "8B target stopped after layer 10")):
        for config in dict.fromkeys(row["config"] for row in data["summary"]):
            cells = {row["tokens"]: row for row in data["summary"] if row["config"] == config}
            per = [f"{cells[n]['wall_us_per_token']}" if n in cells else "" for n in (65536, 131072)]
            worst = max(row.get("max_diff", 0.0) for row in cells.values())
            lines.append(f"| {model} | {config} | {per[0]} | {per[1]} | {worst:.4f} |")
    lines += [
        "",
        "Configuration names: `W<window>-ub<ubatch>`, pinned unless `-nopin`; the score difference is",
        "against the first row of the model, on the same tokens (0.001 is the float noise of any change",
        "of ubatch shape on this GPU).",
        "",
        "## PFlash over HTTP (`bench/gpu/pflash_http.py`, one server per arm, full and PFlash interleaved)",
        "",
        "| arm | prompt tokens | reps | full prefill (s) | PFlash (s) | speedup | draft µs/token | target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    targets = {("drafter", 65536): "10x", ("drafter", 131072): "16x", ("self-default", 65536): "5x",
               ("self-default", 131072): "8x"}
    names = {"drafter": "0.6B drafter (cut to 10 layers)", "self-default": "no drafter: target stopped after layer 10"}
    names |= {f"{arm}-nopin": f"{name}, pin off" for arm, name in list(names.items())}
    names |= {f"{arm}-l{n}": f"{name}, {n} lanes" for arm, name in list(names.items()) for n in range(2, 9)}
    for row in http["summary"]:
        lines.append(f"| {names[row['arm']]} | {row['tokens']:,} | {row['reps']} | {row['full_s']:.2f} | "
                     f"{row['pflash_s']:.2f} | **{row['speedup']:.2f}x** | {row['draft_us_per_token']} | "
                     f"{targets.get((row['arm'], row['tokens']), '')} |")
    lines += ["", "`--pflash auto` at start (both arms calibrate at 32K tokens and keep the 2,048-token threshold):", ""]
    for arm, decision in http["calibration"].items():
        cal = decision["status"]["pflash_calibration"]
        lines.append(f"- {names[arm]}: threshold {decision['status']['pflash_threshold']}, measured PFlash "
                     f"{cal['pflash_s']:.2f} s against {cal['full_s']:.2f} s full at {cal['tokens']:,} tokens "
                     f"({cal['speedup']:.2f}x).")
    lines += [
        "",
        "Machine: one NVIDIA H200 (three bare starts of the device machine, 2026-12-01; runs of different",
        "starts differ by up to 20% in absolute time, so only side-by-side ratios compare). Commands, after",
        "`source bench/gpu/setup.sh`: `bash bench/gpu/draft_profile.sh` (profile; the pinned run:",
        "`python3 bench/gpu/draft_profile.py --model /tmp/models/drafter-0.6b-10l.gguf --layers 9 --reps 1",
        "--trace /tmp/cupti_trace.so`); `python3 bench/gpu/draft_forward.py --model",
        "/tmp/models/drafter-0.6b-10l.gguf --layers 9 --lengths 65536 131072 --reps 2 --configs W2048-ub512",
        "W2048-ub512-nopin W2048-ub1056 W2048-ub2112` (and `--model $TARGET --layers 10`); `python3",
        "bench/gpu/pflash_http.py --target $TARGET --drafter $DRAFTER --reps 3 1`.",
        "",
    ]
    (DOCS / "pflash_draft_profile.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

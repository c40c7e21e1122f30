"""llama_decode's own host work for a decode step of many slots, split by llama.cpp's parts (issue 48 item 5).

The shape of the H200's greedy step at 64 clients, on a CPU where compute is cheap: a generated tiny
model (1 layer, width 16; `--vocab-extra 127000` for the 128K vocabulary, whose output layer is no
longer cheap here), `--slots` slots with a KV stream each of 512 cells (our per_slot layout) or one
unified stream (`--kv unified`), one token a slot per step, every row asking for logits, no sampler
attached (host sampling). The loop fills the batch as engine/runner.py does (Batch.add per row, slots
in order) and times each llama_decode call; `--probe` also times llama.cpp's parts inside the call
with uprobes (perf, root, tracefs): the llama_batch -> llama_batch_ext conversion, the batch's
validation (llama_batch_allocr::init), the KV slot search (llama_kv_cache::init_batch, of which
prepare: a dry run of find_slot/apply per stream that is then undone), the memory context's apply,
graph params and reuse check, set_inputs (the KQ mask, positions, KV indices) and graph_compute
(on a GPU: the launch; here the compute). Each probe adds a few microseconds.

    python bench/decode_host_parts.py --slots 64 --steps 1000 [--kv unified] [--vocab-extra 127000] [--probe]

`--probe` needs perf (apt-get install linux-perf) and tracefs (mount -t tracefs nodev /sys/kernel/tracing).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CELLS, PROMPT = 512, 32
# name: mangled symbol in libllama (0.3.36's llama.cpp)
PROBES = {
    "compat": "_ZN18llama_batch_compatC2EP13llama_contextRK11llama_batchm",
    "validate": "_ZN18llama_batch_allocr4initERK15llama_batch_extRK11llama_vocabb",
    "init_batch": "_ZN14llama_kv_cache10init_batchER18llama_batch_allocrjb",
    "prepare": "_ZN14llama_kv_cache7prepareERKSt6vectorI12llama_ubatchSaIS1_EE",
    "process": "_ZN13llama_context14process_ubatchERK12llama_ubatch14llm_graph_typeP22llama_memory_context_iR11ggml_status",
    "apply": "_ZN22llama_kv_cache_context5applyEv",
    "set_inputs": "_ZN16llm_graph_result10set_inputsEPK12llama_ubatch",
    "compute": "_ZN13llama_context13graph_computeEP11ggml_cgraphb",
    "decode": "llama_decode",
}


def run_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill every slot's prompt, then `args.steps` decode steps of one token a slot; ms per llama_decode."""
    from pflash_plugin.llama.batch import Batch
    from pflash_plugin.llama.context import Context, ContextConfig
    from pflash_plugin.llama.model import Model
    from pflash_plugin.testing import cached_tiny_llama

    path = cached_tiny_llama(vocab_extra=args.vocab_extra, n_layer=1, n_embd=16, n_head=2, n_head_kv=1, n_ff=32)
    model = Model(str(path))
    per_slot = args.kv == "per_slot"
    ctx = Context(model, ContextConfig(n_ctx=args.slots * CELLS, kv_unified=not per_slot, n_batch=512, n_ubatch=512,
                                       n_seq_max=args.slots, n_outputs_max=args.slots, n_threads=args.threads,
                                       n_threads_batch=args.threads, flash_attn=True))
    batch, pos, times = Batch(512), [PROMPT] * args.slots, []
    for first in range(0, args.slots, 8):
        batch.clear()
        for slot in range(first, min(first + 8, args.slots)):
            batch.add_sequence(list(range(5, 5 + PROMPT)), 0, slot, True)
        ctx.decode(batch)
    reused = ctx.graph_reuses()
    for _ in range(args.steps):
        if pos[0] >= CELLS - 1:  # back to the prompt: the streams stay within their cells
            for slot in range(args.slots):
                ctx.memory.seq_rm(slot, PROMPT)
            pos = [PROMPT] * args.slots
        batch.clear()
        for slot in range(args.slots):
            batch.add(7, pos[slot], slot, True)
            pos[slot] += 1
        start = time.perf_counter()
        ctx.decode(batch)
        times.append(time.perf_counter() - start)
    return {"slots": args.slots, "kv": args.kv, "n_vocab": model.n_vocab, "steps": args.steps,
            "decode_ms": round(1000 * statistics.median(times), 3),
            "graph_reuses_per_step": round((ctx.graph_reuses() - reused) / args.steps, 3)}


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """The loop in a child under `perf record` with a uprobe at each part's entry and return; medians
    per decode step (the first 20 steps and the prompts' decodes left out)."""
    import llama_cpp

    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("--probe needs perf (apt-get install linux-perf) and tracefs")
    lib = str(Path(llama_cpp.__file__).parent / "lib" / "libllama.so")
    subprocess.run([perf, "probe", "-q", "-d", "probe_libllama:*"], capture_output=True)
    for name, symbol in PROBES.items():
        for at in (symbol, symbol + "%return"):  # perf names the return probe NAME__return
            subprocess.run([perf, "probe", "-q", "--no-demangle", "-x", lib, "-a", f"{name}={at}"], check=True)
    child = [sys.executable, __file__, *[a for a in sys.argv[1:] if a != "--probe"]]
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/perf.data"
        out = subprocess.run([perf, "record", "-q", "-e", "probe_libllama:*", "-o", data, "--", *child],
                             capture_output=True, text=True, check=True).stdout
        script = subprocess.run([perf, "script", "-i", data, "-F", "time,event"], capture_output=True, text=True,
                                check=True).stdout
    subprocess.run([perf, "probe", "-q", "-d", "probe_libllama:*"], capture_output=True)
    return {**json.loads(out.strip().splitlines()[-1]), "parts_ms": split(script)}


def split(script: str) -> dict[str, float]:
    """Each part's median ms per decode call from perf script's `time: probe_libllama:NAME[_ret]:` lines
    (a function probed at its PLT stub and its body fires twice: its span is first entry to last return)."""
    calls: list[dict[str, list[float]]] = []
    for line in script.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        at, event = float(fields[0].rstrip(":")), fields[1].split(":")[1].replace("__return", "_ret")
        if event == "decode":
            calls.append({})
        if calls:
            calls[-1].setdefault(event, []).append(at)
    parts: dict[str, list[float]] = {}
    for call in calls[20 + 8:]:  # warm steps only
        if "process" not in call or "decode_ret" not in call:
            continue
        for name in PROBES:
            if name in call and f"{name}_ret" in call:
                parts.setdefault(name, []).append(call[f"{name}_ret"][-1] - call[name][0])
        parts.setdefault("process less apply, set_inputs, compute", []).append(
            parts["process"][-1] - parts["apply"][-1] - parts["set_inputs"][-1] - parts["compute"][-1])
        parts.setdefault("decode less its parts", []).append(
            parts["decode"][-1] - parts["process"][-1] - parts["init_batch"][-1] - parts["validate"][-1]
            - parts["compat"][-1])
    return {name: round(1000 * statistics.median(spans), 3) for name, spans in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kv", choices=["per_slot", "unified"], default="per_slot")
    parser.add_argument("--vocab-extra", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="the CPU's compute threads (1: no spinning workers)")
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    if args.probe and os.geteuid() != 0:
        raise SystemExit("--probe needs root (uprobes)")
    print(json.dumps(probe(args) if args.probe else run_loop(args)))


if __name__ == "__main__":
    main()

"""Where the 128-client hang sits: ours as decode_scale's `ours-host-sampling` (128 slots, host sampling),
128 clients x 2 greedy requests, once per variant; a run that does not finish in --limit-s has the
server's threads dumped (py-spy, Python and native frames, twice 5 s apart; /proc's states and wait
channels; SIGUSR1, whose stacks go to the server's log), its threads' CPU (top -H) and the GPU's
utilization sampled, then the server is stopped. On the H200 the hang came in the second wave (every first request answered), at 61fd822 and 7c11b2e on the first 128-client run, at 8ada373
after a 64-client one; the lookup server beside it ran 5x slow meanwhile. As there, an idle lookup
server stays up beside each variant's (`--beside none` leaves it out): an earlier hang of the same look
(docs/multi_gpu.md: two processes under load, the GPUs at 100%, each engine thread in llama_synchronize)
came only with a second process on the device and went with GGML_CUDA_DISABLE_GRAPHS=1 (variant
`nographs=ENV:GGML_CUDA_DISABLE_GRAPHS=1`).
  bash bench/gpu/servers.sh bench/gpu/hang_diag.py --out /tmp/queue/hang_diag_h200.json [--variants ...]
A variant is NAME or NAME=ITEM,ITEM: each item an extra server argument or ENV:KEY=VALUE (its environment).
Since --cuda_graphs auto turns CUDA graphs off past 64 slots (llama/cuda_graphs.py), a variant that
looks at the hang itself passes --cuda_graphs,on.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_scale import ours, throughput  # noqa: E402
from harness import arm_items  # noqa: E402
from multi_gpu import Record, models_parser, run_arms  # noqa: E402


def sh(argv: list[str], timeout: float = 30.0) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return (done.stdout + done.stderr)[-20000:]
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{argv[0]}: {error}"


def dumps(pid: int) -> dict[str, Any]:
    """What the hung server is doing: its threads' stacks twice (moving or not), CPU per thread, the GPU."""
    spy = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
    out: dict[str, Any] = {"gpu": [], "stacks": []}
    for _ in range(2):
        out["gpu"].append(sh(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"]))
        out["stacks"].append(sh([spy, "dump", "--native", "--pid", str(pid)], timeout=60))
        time.sleep(5)
    out["stacks_python"] = sh([spy, "dump", "--pid", str(pid)])
    out["top"] = sh(["top", "-H", "-b", "-n", "1", "-p", str(pid)])
    out["threads"] = threads(pid)
    os.kill(pid, signal.SIGUSR1)  # the server's faulthandler: every thread's Python stack into its log (logs/)
    time.sleep(1)
    return out


def threads(pid: int) -> list[str]:
    """Each thread's name, state and kernel wait channel (where py-spy may not attach: no ptrace)."""
    rows = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            rows.append(f"{task.name} {(task / 'comm').read_text().strip()} {stat[0]} utime={stat[11]} "
                        f"stime={stat[12]} wchan={(task / 'wchan').read_text().strip()}")
        except OSError:
            continue
    return rows


def beside_rate(server: Any, args: Any) -> dict[str, Any]:
    """The idle server's one-client decode (2 greedy requests), or why it did not finish."""
    try:
        return asyncio.run(throughput(server, "greedy", 1, args, seed=7))
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}


def main() -> None:
    parser = models_parser(__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["default"])
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--limit-s", dest="limit_s", type=float, default=40)
    parser.add_argument("--gpu-layers", dest="gpu_layers", type=int, default=-1)
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--beside", choices=("lookup", "none"), default="lookup",
                        help="a server kept up, idle, beside each variant's: decode_scale's ours-lookup (warmed up)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ports = {spec: args.port + i for i, spec in enumerate(args.variants)}
    beside = None
    if args.beside == "lookup":
        beside = ours("ours-lookup", args.port + len(args.variants), args, "off", "--draft_model", "prompt-lookup-decoding")
        beside.launch()
        beside.wait_ready(600)
        asyncio.run(throughput(beside, "greedy", 4, args, seed=1))

    def run(spec: str, record: Record) -> None:
        name, extra, env = arm_items(spec)
        server = ours(name, ports[spec], args, "off", *extra)
        server.env.update(env)
        server.launch()
        row: dict[str, Any] = {"variant": spec}
        try:
            row["ready_s"] = round(server.wait_ready(600), 1)
            asyncio.run(throughput(server, "greedy", 4, args, seed=1))  # decode_scale's warm-up
            row.update(asyncio.run(throughput(server, "greedy", args.clients, args, seed=100 + args.clients)))
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"[:500]
            if server.proc is not None and server.proc.poll() is None:
                if beside is not None:  # slow while the hung one runs: it holds the device (normally ~186 tok/s)
                    row["beside_1_client"] = beside_rate(beside, args)
                row["dumps"] = dumps(server.proc.pid)
        finally:
            server.stop()
        record.add(row)

    try:
        run_arms(args.out, args.variants, run)
    finally:
        if beside is not None:
            beside.stop()

if __name__ == "__main__":
    main()

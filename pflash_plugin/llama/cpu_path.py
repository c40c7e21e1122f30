"""Which CPU path models load with: ggml's extra buffer types (AMX, repacked weights) or not.

On CPUs with AMX (Intel Sapphire Rapids class) a native ggml build can trap with an invalid
opcode at `tilezero` at the first decode of a quantized model: the AMX kernels' tile
configuration is invalid in worker threads (upstream llama.cpp PR 26954). Loading models with
`use_extra_bufts = false` avoids the AMX kernels and decodes fine. Whether this build traps on
this machine can only be seen by running it, so where both the CPU and the build have AMX, a
child process loads a tiny quantized model with extra buffer types and decodes one batch on 2
threads, once per process; if the child dies, models load without extra buffer types.

PFLASH_EXTRA_BUFTS overrides it: `auto` (default: probe where needed), `on` (use them, no probe),
`off` (do not use them, no probe).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import llama_cpp.llama_cpp as C

log = logging.getLogger(__name__)

ENV = "PFLASH_EXTRA_BUFTS"
PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class CpuPath:
    use_extra_bufts: bool
    label: str  # what /status reports: "amx", "default", "no-extra-bufts (why)"


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU advertises AMX tiles (Linux `amx_tile` flag)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines())


def build_has_amx() -> bool:
    """Whether this llama.cpp build's CPU backend was compiled with AMX kernels."""
    return b"AMX_INT8 = 1" in C.llama_print_system_info()


def probe_command() -> list[str]:
    """The child that loads a tiny quantized model with extra buffer types and decodes."""
    return [sys.executable, "-m", "pflash_plugin.llama.amx_probe"]


def run_probe(command: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> CpuPath:
    """Run the probe child; AMX stays on only if it exits cleanly."""
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return _fallback(f"AMX probe hung for {timeout_s:.0f} s", "")
    if child.returncode < 0:
        return _fallback(f"AMX probe crashed: {signal.Signals(-child.returncode).name}", child.stderr)
    if child.returncode != 0:
        return _fallback(f"AMX probe failed: exit {child.returncode}", child.stderr)
    return CpuPath(True, "amx")


def _fallback(reason: str, stderr: str) -> CpuPath:
    tail = stderr.strip().splitlines()[-3:]
    log.warning("loading models without extra buffer types (no AMX, no repacked weights): %s%s",
                reason, "; the probe said: " + " | ".join(tail) if tail else "")
    return CpuPath(False, f"no-extra-bufts ({reason})")


def decide(setting: str, amx: bool, probe: Callable[[], CpuPath]) -> CpuPath:
    """The path for `setting` (auto, on, off) where `amx` says whether CPU and build both have it."""
    if setting == "off":
        return CpuPath(False, f"no-extra-bufts ({ENV}=off)")
    if setting == "on":
        return CpuPath(True, f"{'amx' if amx else 'default'} ({ENV}=on, not probed)")
    if setting != "auto":
        raise ValueError(f"{ENV} must be auto, on or off, got {setting!r}")
    if not amx:
        return CpuPath(True, "default")
    log.info("the CPU and this build have AMX: probing it in a child process (%s=on or off skips this)", ENV)
    return probe()


_lock = threading.Lock()
_verdict: CpuPath | None = None


def verdict() -> CpuPath:
    """This process's path, decided (and probed where needed) on the first call."""
    global _verdict
    with _lock:
        if _verdict is None:
            _verdict = decide(os.environ.get(ENV, "auto").strip().lower(),
                              cpu_has_amx() and build_has_amx(), lambda: run_probe(probe_command()))
            log.info("CPU path: %s", _verdict.label)
        return _verdict

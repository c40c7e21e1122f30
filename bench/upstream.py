"""llama-cpp-python 0.3.36's own batched server as a benchmark peer: `examples/server/server.py` of the
pinned sdist (one file, a JSON config, batched decoding over the same bindings), in its best
configuration for throughput, read off its README and code:
- `n_seq_max` = the slots, `kv_unified` true (its default: one KV pool all sequences share);
- `store_logits` false: with it on (its default) every sampled row copies its whole logits row to
  the host each token, for diagnostics and logprobs it answers anyway on request;
- on a GPU every layer offloaded with flash attention, `n_batch` 2048 / `n_ubatch` 512 as the
  other servers get; on the CPU the machine's cores as threads.
It ignores request fields it does not know (`min_tokens`, `ignore_eos`, `top_k`, `grammar`...).

The script is not in the installed wheel, and it imports `llama_cpp.mtmd_cpp`, which loads
libmtmd: the llama-cpp-python it runs on must be built with `-DLLAVA_BUILD=ON` (the project's own
build turns it off). `PFLASH_UPSTREAM_SERVER` names the script; `PFLASH_UPSTREAM_SITE` a
site-packages folder put first on its PYTHONPATH (such a build). `python bench/upstream.py fetch DIR`
writes DIR/server.py from the pinned sdist (pip download).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import REPO, ServerProcess

VERSION = "0.3.36"
SCRIPT_ENV, SITE_ENV = "PFLASH_UPSTREAM_SERVER", "PFLASH_UPSTREAM_SITE"
# The script imports numpy before llama_cpp; on the H200 machine (numpy of its torch venv) the CUDA
# model load then segfaults (seen 5 of 5; llama_cpp first, the same load works): run it as __main__
# with llama_cpp imported first, its code unchanged.
LAUNCH = "import sys, runpy, llama_cpp; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
# where bench/gpu's bundle carries it (.gpu/ travels to the CUDA machine)
BUNDLED = REPO / ".gpu" / "upstream_server.py"


def script() -> Path:
    """The upstream server script: $PFLASH_UPSTREAM_SERVER, else the GPU bundle's copy."""
    path = Path(os.environ.get(SCRIPT_ENV) or BUNDLED)
    if not path.is_file():
        raise FileNotFoundError(f"no upstream server script at {path}: run `python bench/upstream.py fetch DIR` "
                                f"and set {SCRIPT_ENV}=DIR/server.py")
    return path


def available() -> bool:
    try:
        script()
    except FileNotFoundError:
        return False
    return True


def model_options(model: str, *, slots: int, n_ctx: int, gpu: bool, n_batch: int = 2048,
                  n_ubatch: int = 512, threads: int | None = None) -> dict[str, Any]:
    """The config's `model` section: `n_ctx` is the whole pool (all slots together)."""
    threads = threads or os.cpu_count() or 1
    options: dict[str, Any] = {
        "path": model, "alias": "upstream", "n_ctx": n_ctx, "n_seq_max": slots, "n_batch": n_batch,
        "n_ubatch": n_ubatch, "threads": threads, "threads_batch": threads, "kv_unified": True,
        "store_logits": False,
    }
    if gpu:
        options.update(n_gpu_layers=-1, flash_attn=True, offload_kqv=True)
    return options


@dataclass
class UpstreamServer(ServerProcess):
    """The upstream server with its config written beside its log; it takes no `--port` flag (the
    port is in the config). `ours` False: the benches send it llama-server's request shape."""

    options: dict[str, Any] = field(default_factory=dict)
    ours: bool = False
    ready_paths: tuple[str, ...] = ("/healthz",)

    @property
    def config_path(self) -> Path:
        return self.log_dir / f"{self.label}.config.json"

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-c", LAUNCH, str(script()), "-C", str(self.config_path)]

    def launch(self) -> ServerProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config = {"server": {"host": "127.0.0.1", "port": self.port}, "model": self.options}
        self.config_path.write_text(json.dumps(config, indent=1))
        site = os.environ.get(SITE_ENV)
        if site:
            self.env = {**self.env, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
        return super().launch()


def fetch(folder: Path) -> Path:
    """DIR/server.py from the pinned llama-cpp-python sdist, downloaded by pip."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp,
                        f"llama-cpp-python=={VERSION}"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            member = tar.getmember(f"llama_cpp_python-{VERSION}/examples/server/server.py")
            source = tar.extractfile(member)
            assert source is not None
            (folder / "server.py").write_bytes(source.read())
    return folder / "server.py"


if __name__ == "__main__":
    if sys.argv[1:2] != ["fetch"] or len(sys.argv) != 3:
        sys.exit("usage: python bench/upstream.py fetch DIR")
    print(fetch(Path(sys.argv[2])))

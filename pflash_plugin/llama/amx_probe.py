"""The AMX probe's child process (see cpu_path.py): loads a tiny Q4_0 model with ggml's extra
buffer types and decodes one batch on 2 threads. On a build whose AMX kernels trap, this process
dies by a signal instead of the server.

    python -m pflash_plugin.llama.amx_probe            (writes its model through a second process)
    python -m pflash_plugin.llama.amx_probe --write PATH
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from .batch import Batch
from .context import Context, ContextConfig
from .model import Model

TOKENS = 32  # more than one row: a single row takes ggml's VNNI kernels, not the AMX tiles


def write(path: Path) -> None:
    from .tiny_gguf import write_tiny_llama

    # Q4_0 rows of 256: a type and shape that ggml's AMX buffer takes (out features a multiple of
    # 32), and the repacked CPU buffer where there is no AMX (so the same path runs there too)
    write_tiny_llama(path, n_layer=1, n_embd=256, n_head=4, n_head_kv=4, n_ff=512, quant="q4_0")


def probe() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "amx-probe.gguf"
        # another process writes it: loading a GGUF in the process that wrote it with the gguf
        # package segfaulted on the GPU machine (shared/gpu/README.md)
        subprocess.run([sys.executable, "-m", "pflash_plugin.llama.amx_probe", "--write", str(path)], check=True)
        model = Model(path, use_extra_bufts=True)
        ctx = Context(model, ContextConfig(n_ctx=64, n_batch=TOKENS, n_ubatch=TOKENS, n_threads=2, n_threads_batch=2))
        batch = Batch(TOKENS)
        batch.add_sequence([model.bos] + [100] * (TOKENS - 1), 0, 0, True)
        ctx.decode(batch)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(Path(sys.argv[2]))
    else:
        probe()

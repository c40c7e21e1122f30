"""A copy of a GGUF model cut after its first N layers, for a drafter that never runs the rest.

Why: the drafter stops its graph after the last scoring layer (the eval callback returns false),
yet on an H200 the 0.6B drafter (28 layers) stopped after layer 9 drafted 64K tokens in 0.97-1.12 s,
as long as the whole model without the capture (0.99-1.02 s), while a copy cut to 10 layers, also
without the capture, took 0.53-0.54 s (docs/multi_gpu.md). On 2 CPU cores the cut copy drafts 11%
faster than the early stop (bench/gpu/draft_forward.py --cut). It also loads a fraction of the
layers' weights.

The copy is written once per source file and layer count into a cache directory, by a child
process (`python -m pflash_plugin.llama.gguf_cut SRC DST N`): loading a GGUF in the process that
wrote it with the gguf package segfaulted on the CUDA machine, and the child's memory is freed
when it ends.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CUT_TIMEOUT_S = 600  # a multi-GB drafter copies in well under a minute on a local disk


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pflash_plugin" / "drafters"


def cut_path(src: str | os.PathLike, n_layers: int, cache_dir: Path) -> Path:
    """Where the cut copy of `src` lives: named by the source's path, size and mtime, so a changed
    source gets a new copy."""
    stat = os.stat(src)
    key = f"{os.path.abspath(src)}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return cache_dir / f"{Path(src).stem}-{digest}-{n_layers}l.gguf"


def cut_layers(src: str | os.PathLike, dst: str | os.PathLike, n_layers: int) -> None:
    """Write `dst`: `src` with its blocks from `n_layers` on left out, `<arch>.block_count` set to
    `n_layers`, and per-layer metadata arrays cut to match (llama.cpp checks their length)."""
    import gguf  # only here: the server imports this module without needing gguf loaded

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    n_block = int(reader.fields[count_key].contents())
    if not 0 < n_layers < n_block:
        raise ValueError(f"cannot cut {src} ({n_block} layers) to {n_layers} layers")
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == count_key:
            value = n_layers
        elif sub_type not in (None, gguf.GGUFValueType.STRING) and len(value) == n_block:
            value = value[:n_layers]  # one entry per layer (head counts, feed-forward widths, ...)
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)
    kept = [t for t in reader.tensors if not _block_at_or_after(t.name, n_layers)]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()


def _block_at_or_after(name: str, n_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= n_layers


def cached_cut(src: str | os.PathLike, n_layers: int, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The cut copy of `src` (in `cache_dir`, default_cache_dir() if None), written by a child
    process unless the cache has it; None (and a warning) where it cannot be written, so the
    caller loads the whole model instead."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    _remove_dead_writers(cache_dir)
    dst = cut_path(src, n_layers, cache_dir)
    if dst.exists():
        return dst
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    log.info("writing the drafter %s cut to %d layers, once, to %s", src, n_layers, dst)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", __name__, os.fspath(src), os.fspath(tmp), str(n_layers)],
                              capture_output=True, text=True, timeout=CUT_TIMEOUT_S)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"exit status {done.returncode}")
        os.replace(tmp, dst)  # atomic: another server starting beside this one sees all or nothing
        return dst
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        log.warning("could not write the drafter cut to %d layers under %s (%s): loading the whole drafter",
                    n_layers, cache_dir, error)
        with contextlib.suppress(OSError):  # no file, or no directory to hold one
            tmp.unlink()
        return None


def _remove_dead_writers(cache_dir: Path) -> None:
    """Delete the temporary copies (`*.gguf.<pid>.tmp`) whose writer is gone: a server killed while
    cutting leaves one behind, as large as the cut model, that nothing else would remove."""
    for tmp in cache_dir.glob("*.gguf.*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):  # another server removed it first
                tmp.unlink()
                log.info("removed %s, left by a server that died while writing it", tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


if __name__ == "__main__":
    cut_layers(sys.argv[1], sys.argv[2], int(sys.argv[3]))

"""Patches for the pinned llama-cpp-python, applied to the installed package on request
(`python -m pflash_plugin.vendor_patches apply|check|revert`).

The one patch gives stock `llama_cpp.server` a plugin hook (llama_cpp/server/plugins.py). Every
operation first reads the state of each patched file (original, patched, or modified by someone
else), refuses a version other than the pinned one, computes every new file in memory, and only
then writes, restoring what it wrote if a write fails: the package is never left half-patched.
"""
from __future__ import annotations

import enum
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .unidiff import FilePatch, PatchError, apply, parse

SUPPORTED_VERSION = "0.3.36"
PATCH = Path(__file__).with_name(f"llama-cpp-python-{SUPPORTED_VERSION}-server-plugins.patch")
# the files the patch changes, as the {SUPPORTED_VERSION} release ships them: any other content is "modified"
STOCK_SHA256 = {
    "llama_cpp/server/app.py": "81c5a5be463cfb89b6961fe5c0085234a9004f7d2e41571b224ede45dd47cba7",
    "llama_cpp/server/__main__.py": "1cbf72bcf5f497b172fc1e2dec96e892e714f425f95270b1e284549c18a4b696",
}


class State(enum.Enum):
    ORIGINAL = "original"
    PATCHED = "patched"
    MODIFIED = "modified"


@dataclass
class Target:
    """The installed package: the directory that holds `llama_cpp/` and its version."""

    root: Path
    version: str

    @classmethod
    def installed(cls) -> Target:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.origin is None:
            raise PatchError("llama-cpp-python is not installed")
        return cls(Path(spec.origin).parent.parent, metadata.version("llama-cpp-python"))


def _read(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.exists() else None


def _is_stock(patch: FilePatch, text: str | None) -> bool:
    if patch.new_file:
        return text is None
    return text is not None and hashlib.sha256(text.encode("utf-8")).hexdigest() == STOCK_SHA256[patch.path]


def _state(patch: FilePatch, text: str | None) -> State:
    """Whole-file states: stock bytes, or stock bytes once the patch is reverted; else modified."""
    if _is_stock(patch, text):
        return State.ORIGINAL
    try:
        return State.PATCHED if _is_stock(patch, apply(patch, text, reverse=True)) else State.MODIFIED
    except PatchError:
        return State.MODIFIED


def states(target: Target) -> dict[str, State]:
    _check_version(target)
    return {p.path: _state(p, _read(target.root / p.path)) for p in parse(PATCH.read_text(encoding="utf-8"))}


def _check_version(target: Target) -> None:
    if target.version != SUPPORTED_VERSION:
        raise PatchError(
            f"this patch is for llama-cpp-python {SUPPORTED_VERSION} only; the installed version is "
            f"{target.version} (install llama-cpp-python=={SUPPORTED_VERSION}, or use python -m pflash_plugin.server)"
        )


def _write_all(target: Target, contents: dict[str, str | None]) -> None:
    """Write every file (None: delete it), restoring the ones written if one write fails."""
    previous = {path: _read(target.root / path) for path in contents}
    done: list[str] = []
    try:
        for path, text in contents.items():
            _put(target.root / path, text)
            done.append(path)
    except BaseException:
        for path in done:
            _put(target.root / path, previous[path])
        raise


def _put(path: Path, text: str | None) -> None:
    if text is None:
        path.unlink(missing_ok=True)
        return
    temporary = path.with_name(path.name + ".pflash-tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _change(target: Target, to: State) -> bool:
    """Bring every file to `to` (PATCHED or ORIGINAL); False if they all were already."""
    found = states(target)
    modified = [path for path, state in found.items() if state is State.MODIFIED]
    if modified:
        raise PatchError("refusing to touch llama-cpp-python: modified since install (neither original nor "
                         f"patched): {', '.join(modified)}")
    patches = {p.path: p for p in parse(PATCH.read_text(encoding="utf-8"))}
    contents = {
        path: apply(patches[path], _read(target.root / path), reverse=to is State.ORIGINAL)
        for path, state in found.items() if state is not to
    }
    _write_all(target, contents)
    return bool(contents)


def apply_patch(target: Target) -> bool:
    """Patch the package; idempotent (False: it already was)."""
    return _change(target, State.PATCHED)


def revert_patch(target: Target) -> bool:
    """Restore the stock files; False: nothing to revert."""
    return _change(target, State.ORIGINAL)

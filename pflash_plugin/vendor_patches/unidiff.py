"""A small unified-diff reader and exact hunk applier: no fuzz, no offsets beyond a search for the
hunk's whole context, so a file that was edited by hand is reported instead of patched wrongly."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    pass


@dataclass
class Hunk:
    old: list[str]  # context and removed lines, as in the original file
    new: list[str]  # context and added lines, as in the patched file
    old_start: int  # 0-based line where `old` is expected


@dataclass
class FilePatch:
    path: str  # relative to the patched tree, e.g. llama_cpp/server/app.py
    new_file: bool = False
    hunks: list[Hunk] = field(default_factory=list)


def parse(text: str) -> list[FilePatch]:
    """The file patches of a unified diff (`--- a/x`, `+++ b/x` headers; text before them is ignored)."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        old_name, new_name = lines[i][4:].strip(), lines[i + 1][4:].strip()
        files.append(FilePatch(new_name.removeprefix("b/"), new_file=old_name == "/dev/null"))
        i += 2
        while i < len(lines) and (match := _HUNK.match(lines[i])):
            old_len = int(match.group(2) or 1)
            new_len = int(match.group(4) or 1)
            hunk = Hunk([], [], max(int(match.group(1)) - 1, 0))
            i += 1
            while (len(hunk.old) < old_len or len(hunk.new) < new_len) and i < len(lines):
                tag, body = lines[i][:1], lines[i][1:]
                if tag in (" ", "\n"):
                    body = body if tag == " " else "\n"
                    hunk.old.append(body)
                    hunk.new.append(body)
                elif tag == "-":
                    hunk.old.append(body)
                elif tag == "+":
                    hunk.new.append(body)
                elif tag != "\\":  # "\ No newline at end of file"
                    raise PatchError(f"malformed hunk in {files[-1].path}: {lines[i]!r}")
                i += 1
            if len(hunk.old) != old_len or len(hunk.new) != new_len:
                raise PatchError(f"truncated hunk in {files[-1].path}")
            files[-1].hunks.append(hunk)
    if not files:
        raise PatchError("no file patches found")
    return files


def _find(lines: list[str], block: list[str], near: int) -> int | None:
    """Where `block` occurs in `lines`, the occurrence nearest `near`."""
    hits = [i for i in range(len(lines) - len(block) + 1) if lines[i:i + len(block)] == block]
    return min(hits, key=lambda i: abs(i - near)) if hits else None


def apply(patch: FilePatch, text: str | None, reverse: bool = False) -> str | None:
    """`text` with the patch applied (or reverted); None where the result is "no file" (a new file,
    reverted). Raises PatchError where a hunk's lines are not found."""
    if patch.new_file:
        added = "".join(patch.hunks[0].new) if patch.hunks else ""
        if reverse:
            if text != added:
                raise PatchError(f"{patch.path} differs from the file the patch added")
            return None
        if text is not None:
            raise PatchError(f"{patch.path} already exists")
        return added
    if text is None:
        raise PatchError(f"{patch.path} is missing")
    lines = text.splitlines(keepends=True)
    shift = 0
    for hunk in patch.hunks:
        before, after = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
        at = _find(lines, before, hunk.old_start + shift)
        if at is None:
            raise PatchError(f"{patch.path}: a hunk near line {hunk.old_start + 1} does not match")
        lines[at:at + len(before)] = after
        shift += len(after) - len(before)
    return "".join(lines)

"""A llama.cpp context's KV memory, per sequence: cells removed, copied, moved, read, saved and
restored.

Why apart from context.py: llama.cpp keeps the two apart too (`llama_get_memory` gives the
context's memory, which the `llama_memory_seq_*` calls take): a context decodes and gives its
outputs, its memory holds each sequence's cells, which the engine's prefix cache, host tier and
speculation edit between decodes.
"""
from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp.llama_cpp as C

from .held import holding_gil

# cells' bookkeeping (no device work), 10-24 a step while requests are admitted (bench/vision_steps.py --calls)
_seq_rm_held = holding_gil(C.llama_memory_seq_rm)


class Memory:
    """The KV cells of a context's sequences (Context.memory); valid while the context is open."""

    def __init__(self, ctx: Any) -> None:
        """`ctx`: the llama.cpp context pointer (a sequence's state is saved and restored through it)."""
        self._ctx = ctx
        self._mem = C.llama_get_memory(ctx)

    def seq_rm(self, seq_id: int, start: int = 0, end: int = -1) -> None:
        if not _seq_rm_held(self._mem, seq_id, start, end):
            raise RuntimeError(f"llama.cpp could not remove positions {start}..{end} of sequence {seq_id}")

    def seq_cp(self, src: int, dst: int, start: int, end: int) -> None:
        C.llama_memory_seq_cp(self._mem, src, dst, start, end)

    def seq_add(self, seq_id: int, start: int, end: int, delta: int) -> None:
        """Move the positions [start, end) of a sequence by `delta` (K is re-rotated at the next decode)."""
        C.llama_memory_seq_add(self._mem, seq_id, start, end, delta)

    @property
    def can_shift(self) -> bool:
        """Whether this context's KV cache can move positions (seq_add); some architectures cannot."""
        return bool(C.llama_memory_can_shift(self._mem))

    def seq_pos_max(self, seq_id: int) -> int:
        return C.llama_memory_seq_pos_max(self._mem, seq_id)

    def seq_pos_min(self, seq_id: int) -> int:
        """The sequence's first cell (-1: none); in a window-sized SWA cache, that of the SWA layers."""
        return C.llama_memory_seq_pos_min(self._mem, seq_id)

    def clear(self) -> None:
        C.llama_memory_clear(self._mem, True)

    def state_seq_get(self, seq_id: int, max_bytes: int) -> bytes | None:
        """One sequence's cells (positions, K and V) as llama.cpp serializes them, copied to host
        RAM; None when that is over `max_bytes` (nothing is copied)."""
        size = C.llama_state_seq_get_size(self._ctx, seq_id)
        if size > max_bytes:
            return None
        buf = (ctypes.c_uint8 * size)()
        written = C.llama_state_seq_get_data(self._ctx, buf, size, seq_id)
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} bytes of sequence {seq_id}'s state")
        return ctypes.string_at(buf, written)

    def state_seq_set(self, seq_id: int, data: bytes) -> None:
        """Load a sequence saved by `state_seq_get` into `seq_id` (which must be empty)."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if C.llama_state_seq_set_data(self._ctx, buf, len(data), seq_id) == 0:
            raise RuntimeError(f"llama.cpp could not restore {len(data)} bytes of state into sequence {seq_id}")

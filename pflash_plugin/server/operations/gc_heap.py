"""The heap as it stands once the server has started, frozen out of Python's cyclic garbage
collector (gc.freeze): a full collection walks every object the process holds, stopping every
thread (the engine's, the event loop) while it runs. With the demo model loaded (~115K tracked
objects, 2 CPU cores) one took 42-57 ms in the first round of mix8's shape after start; with the
startup heap frozen none ran, and a later one scans only what came after the start
(bench/gc_pauses.py, docs/first_token_cpu.md). vLLM freezes its heap after start for the same reason.
Unfrozen again at shutdown, so an app that stops inside a longer-lived process (the tests, an app
mounting ours) leaves nothing uncollectable behind."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_heap() -> Iterator[None]:
    gc.collect()  # what startup left unreachable goes now: frozen, it never would
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

"""llama.cpp's log callback: lines assembled per thread, continuation lines, filtered levels."""
from __future__ import annotations

import logging
import threading

from pflash_plugin.llama import log as llama_log

CONT, DEBUG, WARN = 5, 1, 3


def test_lines_of_two_threads_are_assembled_apart_and_a_filtered_message_leaves_nothing(caplog):
    llama_log.log.setLevel(logging.WARNING)
    barrier = threading.Barrier(2)

    def write(name: str) -> None:
        llama_log._callback(WARN, f"{name} starts ".encode(), None)
        barrier.wait()  # both threads hold a partial line now
        llama_log._callback(CONT, f"and {name} ends\n".encode(), None)

    with caplog.at_level(logging.WARNING, logger="llama.cpp"):
        threads = [threading.Thread(target=write, args=(n,)) for n in ("engine", "drafter")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        llama_log._callback(WARN, b"unfinished ", None)
        llama_log._callback(DEBUG, b"filtered out\n", None)  # a new message drops the unfinished one
        llama_log._callback(WARN, b"next line\n", None)
    lines = sorted(r.getMessage() for r in caplog.records if r.name == "llama.cpp")
    assert lines == ["drafter starts and drafter ends", "engine starts and engine ends", "next line"]

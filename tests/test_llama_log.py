"""llama.cpp's log callback: lines assembled per thread, continuation lines, filtered levels."""
from __future__ import annotations

import logging
import threading

import pytest

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


def test_a_decode_aborted_on_request_logs_no_error_but_a_real_failure_still_does(tiny_model, caplog):
    # llama.cpp logs an abort as failed compute (two errors, a warning, an error): the engine and the
    # drafter abort on purpose, so those lines must not reach an operator as errors
    from pflash_plugin.llama import Batch, Context, ContextConfig, DecodeError, Model

    model = Model(tiny_model)
    ctx = Context(model, ContextConfig(n_ctx=256, n_batch=64))
    batch = Batch(64, 1)
    try:
        batch.add_sequence(list(range(1, 33)), 0, 0, False)
        ctx.set_abort(lambda: True)
        with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
            llama_log.log.setLevel(logging.DEBUG)
            with pytest.raises(DecodeError) as aborted:
                ctx.decode(batch)
            hushed = [r for r in caplog.records if r.name == "llama.cpp"]
            caplog.clear()
            ctx.set_abort(lambda: False)
            batch.clear()
            batch.add_sequence([model.n_vocab + 5], 32, 0, False)  # a token the model has not: a real failure
            with pytest.raises(DecodeError):
                ctx.decode(batch)
            failed = [r for r in caplog.records if r.name == "llama.cpp"]
    finally:
        llama_log.log.setLevel(logging.WARNING)
        batch.close()
        ctx.close()
        model.close()
    assert aborted.value.code == 2
    assert any("failed to decode" in r.getMessage() for r in hushed)  # the lines are there, at debug level
    assert all(r.levelno == logging.DEBUG for r in hushed)
    assert any(r.levelno >= logging.WARNING for r in failed)

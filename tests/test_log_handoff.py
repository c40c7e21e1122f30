"""Log records written on a listener thread (server/operations/log_handoff.py): the thread that logs
(the event loop, the engine's) only queues them; uvicorn's access lines keep their fields."""
from __future__ import annotations

import logging
import threading

from uvicorn.logging import AccessFormatter

from pflash_plugin.server.operations.log_handoff import hand_off_logging, write_out


class Recorded(logging.Handler):
    """Each line it formats, and the thread that wrote it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []
        self.written = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.format(record), threading.current_thread().name))
        self.written.set()


def test_records_are_written_on_a_listener_thread_with_their_fields(monkeypatch):
    logger = logging.getLogger("pflash-test-access")
    recorded = Recorded()
    recorded.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False))
    monkeypatch.setattr(logger, "handlers", [recorded])
    monkeypatch.setattr(logger, "propagate", False)
    logger.setLevel(logging.INFO)
    hand_off_logging([logger])
    try:
        assert logger.handlers != [recorded]  # a queue now stands in front of it
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST", "/v1/completions", "1.1", 200)
        assert recorded.written.wait(10)
    finally:
        write_out()
    assert logger.handlers == [recorded]  # its own handler back
    (line, thread), = recorded.lines
    assert line == '127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200 OK'  # the status phrase: its args read
    assert thread != threading.current_thread().name

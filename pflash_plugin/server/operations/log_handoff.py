"""Log records written on a thread of their own: the event loop (uvicorn's access line for each
request, our warnings) and the engine's threads only hand a record over.

A handler's write flushes its stream, a system call that releases the GIL; a thread coming back from it
waits for the GIL while the others hold it. In mix8 on an H100 (py-spy, docs/first_token_cpu.md) the
access line of a short request, written as its first token was, held the event loop 6.9 ms while four
long prompts were prepared beside it. Python's QueueHandler/QueueListener is the standard way out."""
from __future__ import annotations

import logging
import queue
from logging.handlers import QueueHandler, QueueListener


class _Handoff(QueueHandler):
    """A QueueHandler that hands the record over as it is: its listener runs in this process, and
    uvicorn's access formatter reads the record's args, which QueueHandler.prepare would drop."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


_handed: list[tuple[logging.Logger, list[logging.Handler], QueueListener]] = []


def hand_off_logging(loggers: list[logging.Logger] | None = None) -> None:
    """Each of `loggers` (default: every logger holding handlers now: the root, uvicorn's) gets one
    handler that queues its records; a listener thread per logger writes them to the handlers it had
    (their levels kept) until `write_out`."""
    if loggers is None:
        loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                           if isinstance(logger, logging.Logger)]
    for logger in loggers:
        if not logger.handlers or any(isinstance(handler, _Handoff) for handler in logger.handlers):
            continue
        records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        listener = QueueListener(records, *logger.handlers, respect_handler_level=True)
        _handed.append((logger, logger.handlers, listener))
        logger.handlers = [_Handoff(records)]
        listener.start()


def write_out() -> None:
    """Every record queued so far written, the listeners ended and the loggers' own handlers back
    (at the end of serving, and before an exit that skips the interpreter's)."""
    while _handed:
        logger, handlers, listener = _handed.pop()
        logger.handlers = handlers
        listener.stop()

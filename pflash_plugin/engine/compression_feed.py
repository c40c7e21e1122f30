"""The engine's side of the compression thread: the requests the scheduler handed off, given to
the compressor, their results coming back to the engine as messages (never a call into the
scheduler from the compression thread)."""
from __future__ import annotations

import copy
from typing import Callable

from .handoff import shared_jobs
from .request import Report, Request
from .seams import Activity, CompressionResult, Compressor


def feed(compressor: Compressor | None, handed: list[Request], activity: Activity,
         resume: Callable[[Request, list[int], Report], None]) -> None:
    """Give the compressor the handed-off requests: a job that several requests share (the n
    samples of one prompt) runs once, and its result goes to each through `resume` (called on the
    compression thread, with a report of its own)."""
    for job, requests in shared_jobs(handed):
        assert compressor is not None

        def deliver(result: CompressionResult, requests: list[Request] = requests) -> None:
            for request in requests:
                resume(request, result.tokens, copy.copy(result.report))

        compressor.submit(job, activity, deliver)

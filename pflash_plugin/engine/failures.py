"""What a failed step costs: the requests it served, or the model when llama.cpp itself failed.

A failure tied to one request fails that request alone; a decode that found no KV cells is retried
once idle caches are evicted, an aborted one up to three times; only an allocation or compute
failure inside llama.cpp marks the model failed (`reason`), after which it takes no requests.
"""
from __future__ import annotations

import logging

from ..llama import DecodeError
from .request import ErrorEvent, ErrorKind, Request, RequestStatus
from .scheduler import Scheduler, Step

log = logging.getLogger(__name__)


class Failures:
    """The engine's failure state over its scheduler (`name`: the model, in messages)."""

    def __init__(self, scheduler: Scheduler, name: str) -> None:
        self.scheduler, self.name = scheduler, name
        self.reason: str | None = None  # llama.cpp failed: why (the model takes no more requests)
        self.aborts = 0  # consecutive aborted decodes

    def step_failed(self, step: Step, error: Exception) -> None:
        log.exception("engine %s: step failed", self.name)
        self.fail_step(step, ErrorKind.FAILED, f"the step failed: {type(error).__name__}: {error}")

    def decode_error(self, step: Step, error: DecodeError) -> None:
        if error.code == 1 and self.scheduler.cache.evict_idle():
            if any(item.media is not None for item in step.items):  # its media's earlier calls wrote cells
                self.scheduler.steps.rollback(step)
            return  # nothing was written by the failed call; retry the same work next step with the caches freed
        if error.code == 2 and self.aborts < 3:
            self.aborts += 1
            self.scheduler.steps.rollback(step)
            return  # aborted: retry the step
        log.error("engine %s: %s", self.name, error)
        if error.code <= -2:  # allocation or compute failure inside llama.cpp: the model is broken
            self.fail_model(str(error))
        else:
            self.fail_step(step, ErrorKind.MODEL_FAILED if error.code == 1 else ErrorKind.FAILED, str(error))

    def fail_step(self, step: Step, kind: ErrorKind, message: str) -> None:
        for request in {id(i.request): i.request for i in step.items}.values():
            if request.status.running:
                self.fail(request, kind, message)
        self.scheduler.steps.unpad(step)

    def fail_model(self, reason: str) -> None:
        self.reason = reason
        for request in self.scheduler.live:
            self.fail(request, ErrorKind.MODEL_FAILED, f"the model {self.name} failed: {reason}")

    def fail(self, request: Request, kind: ErrorKind, message: str) -> None:
        """Fail a request after a step went wrong; its slot's KV is in an unknown state."""
        error = ErrorEvent(kind, f"request {request.request_id}: {message}")
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, error, forget_kv=True)

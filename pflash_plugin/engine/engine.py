"""One scheduler thread per model: owns the llama context, runs steps, serves submissions.

Other threads talk to it only through `submit` and `cancel`, which post to an inbox; every
scheduler and KV mutation happens on the engine thread, so none of it needs a lock.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from ..llama import DecodeError
from .request import ErrorEvent, Request, RequestState
from .scheduler import AdmissionError, Scheduler, Step

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, scheduler: Scheduler, runner: Any, name: str = "engine", compressor: Any = None) -> None:
        """`compressor` (optional) has `submit(job, deliver)`: it runs `job` on its own thread and
        calls `deliver(result)` with `result.tokens` and `result.report`."""
        self.scheduler, self.runner, self.name = scheduler, runner, name
        self.compressor = compressor
        self._interactive = False  # requests wait for a first token: background work steps aside
        if compressor is not None:
            scheduler.handoff = self._hand_to_compressor
            compressor.should_yield = lambda: self._interactive
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._status: dict = scheduler.status()
        self._status_lock = threading.Lock()
        self.steps = 0
        self._aborts = 0  # consecutive aborted decodes
        # a step that prefills one long prompt alone is preempted when a message arrives, so a
        # newcomer does not wait for the whole step (the next step caps that prompt's chunk)
        self._preemptible = False
        self._arrival = threading.Event()
        if hasattr(runner, "set_abort"):
            runner.set_abort(lambda: self._preemptible and self._arrival.is_set())
        self._thread = threading.Thread(target=self._loop, name=f"pflash-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- called from any thread ------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request; raises AdmissionError at once for what can never be served."""
        self.scheduler.check(request)  # reads only immutable limits and the queue length
        self._post(lambda: self._admit_checked(request))

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        self._post(lambda: self.scheduler.finish(request, "cancelled"))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread (used by the compressor to hand results back)."""
        self._post(fn)

    def status(self) -> dict:
        with self._status_lock:
            return dict(self._status)

    def _hand_to_compressor(self, request: Request) -> None:
        def deliver(result: Any) -> None:  # on the compression thread: post back, touch nothing
            self._post(lambda: self.scheduler.resume(request, result.tokens, result.report))

        self.compressor.submit(request.compression, deliver)

    # ---- engine thread ---------------------------------------------------------------------
    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self._wake.set()
        self._arrival.set()

    def _admit_checked(self, request: Request) -> None:
        if request.cancelled:
            return
        try:
            self.scheduler.check(request)
        except AdmissionError as error:
            request.state = RequestState.FINISHED
            request.sink(ErrorEvent(error.status, error.message, error.type))
            return
        self.scheduler.add(request)

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:  # a bad message must not kill the thread
                log.exception("engine %s: inbox task failed", self.name)

    def _loop(self) -> None:
        while not self._stop:
            try:
                self._iterate()
            except Exception:  # a bug must cost the requests in flight, never the thread
                log.exception("engine %s: scheduling failed; failing the requests in flight", self.name)
                for request in [*self.scheduler.running, *self.scheduler.waiting]:
                    self.scheduler.fail(request, 500, "internal scheduler error")
                    self.scheduler.drop_kv(request)

    def _iterate(self) -> None:
        self._arrival.clear()
        self._drain_inbox()
        step = self.scheduler.schedule() if self.scheduler.has_work else Step([])
        self._publish_status()
        if not step.items:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            return
        self._run(step)
        self.steps += 1

    def _run(self, step: Step) -> None:
        self._preemptible = self.scheduler.preemptible(step)
        try:
            outputs = self.runner.execute(step)
        except DecodeError as error:
            if error.code == 2 and self._preemptible and self._arrival.is_set():
                self.scheduler.rollback(step)  # preempted for a newcomer: redo with it next step
            else:
                self._on_decode_error(step, error)
            return
        except Exception as error:  # sampling or anything else: fail this step's requests only
            log.exception("engine %s: step failed", self.name)
            self._fail_step(step, 500, f"internal error: {error}")
            return
        finally:
            self._preemptible = False
        self._aborts = 0
        self.scheduler.update(step, outputs)

    def _on_decode_error(self, step: Step, error: DecodeError) -> None:
        if error.code == 1 and self.scheduler.evict_idle():
            return  # nothing was written; retry the same work next step with the caches freed
        if error.code == 2 and self._aborts < 3:
            self._aborts += 1
            self.scheduler.rollback(step)
            return  # aborted: retry the step
        log.error("engine %s: %s", self.name, error)
        self._fail_step(step, 503 if error.code == 1 else 500, str(error))

    def _fail_step(self, step: Step, status: int, message: str) -> None:
        for request in {id(i.request): i.request for i in step.items}.values():
            if request.state is RequestState.RUNNING:
                self.scheduler.fail(request, status, message)
                self.scheduler.drop_kv(request)

    def _publish_status(self) -> None:
        sched = self.scheduler
        self._interactive = any(r.timings.first_token is None for r in sched.running) or any(
            r.compression is None for r in sched.waiting
        )
        status = sched.status()
        status["steps"] = self.steps
        with self._status_lock:
            self._status = status

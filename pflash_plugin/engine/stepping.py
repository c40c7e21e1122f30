"""One step on the runner, on the engine thread: the launch, the last step's text and events beside
the decode where the runner overlaps, the tokens taken; a step that prefills one long prompt alone
aborted for a newcomer; a failed step's cost routed to failures.py.

Where the runner overlaps (the output layer on a GPU: `llama_decode` returns while the device
computes), the last step's text, stats and events go out between the launch and the collect, so
that host work runs beside the device. A step of more tokens than one ubatch returns from its
launch only as its last ubatch computes (runner.returns_early): its text goes out before the launch,
else a short request's first token, decoded beside a long prompt, would reach its client a step late.
"""
from __future__ import annotations

import threading

from ..llama import DecodeError
from .failures import Failures
from .published import Published
from .scheduler import Scheduler, Step
from .seams import Runner


class Stepping:
    """Runs steps (`run`) and counts them (`count`); `arrival` is set by a submission from any
    thread and cleared by the engine each round: a preemptible step in flight is then aborted."""

    def __init__(self, scheduler: Scheduler, runner: Runner, failures: Failures, published: Published) -> None:
        self.scheduler, self.runner, self.failures, self.published = scheduler, runner, failures, published
        self.count = 0
        # a step that prefills one long prompt alone is preempted when a new request arrives, so
        # the newcomer does not wait for the whole step (the next step caps that prompt's chunk)
        self._preemptible = False
        self.arrival = threading.Event()
        runner.set_abort(lambda: self._preemptible and self.arrival.is_set())

    def run(self, step: Step) -> None:
        """One step, counted once it has run (whatever became of it)."""
        self._run(step)
        self.count += 1

    def _run(self, step: Step) -> None:
        """Launch the step's decode; where it runs beside the host (a GPU), release the last step's
        text and events meanwhile, or before the launch where the launch itself would wait for
        most of the step (runner.returns_early); then take its tokens."""
        steps = self.scheduler.steps
        beside = self.runner.returns_early(step)
        if self.runner.overlaps and not beside:
            self.release_last()  # a short request's first token would wait out a long chunk's ubatches
        self._preemptible = steps.preemptible(step)
        steps.started(step)
        try:
            self.runner.launch(step)
        except DecodeError as error:
            if error.code == 2 and self._preemptible and self.arrival.is_set():
                steps.rollback(step)  # preempted for a newcomer: redo with it next step
            else:
                self.failures.decode_error(step, error)
            return
        except Exception as error:  # anything else: fail this step's requests only
            self.failures.step_failed(step, error)
            return
        finally:
            self._preemptible = False
        self.failures.aborts = 0
        if beside:
            self.release_last()
        try:
            outputs = self.runner.collect(step)
        except Exception as error:
            steps.rollback(step)  # its writes, also for rows of requests that ended meanwhile
            self.failures.step_failed(step, error)
            return
        steps.verified(step, outputs)
        self.scheduler.update(step, outputs, release=not self.runner.overlaps)

    def release_last(self) -> None:
        """Where the runner overlaps: the last step's text and events, after the stats (built again
        only where this round's are stale)."""
        self.scheduler.release_text()
        if self.published.stale():
            self.published.stats_now(self.count)
        self.scheduler.emit()

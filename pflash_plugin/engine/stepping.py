"""One step on the runner, on the engine thread: the launch, the last step's text and events beside
the decode where the runner overlaps, the tokens taken; a step of long prefill chunks cut short for
a newcomer (step_policy.py says which steps and which newcomers); a failed step's cost routed to
failures.py.

The cut is llama.cpp's abort callback, polled between graph nodes on the CPU backend only (llama.h:
"currently works only with CPU execution"; ggml-cuda never polls it). On a GPU it still cuts a step
between ubatches: each ubatch's graph opens with the token embeddings' lookup, which stays on the
CPU (llama-model.cpp keeps the input layer there; ggml-cuda never offloads GET_ROWS), so the poll
runs as each ubatch is set up, while the GPU computes the one before. llama.cpp then removes the
aborted ubatch's cells and keeps those of the ubatches before it, which the step keeps too
(Steps.preempted).

Where the runner overlaps (the output layer on a GPU: `llama_decode` returns while the device
computes), the last step's text, stats and events go out between the launch and the collect, so
that host work runs beside the device. A step of more tokens than one ubatch returns from its
launch only as its last ubatch computes (runner.returns_early): its text goes out before the launch,
else a short request's first token, decoded beside a long prompt, would reach its client a step late.
A request's first token goes out as its step is collected, not beside the next decode: that waits
for the next round's admissions and planning and the launch's host work (inputs, the graph); mix8's
short requests' first text left the H200's engine 6-24 ms after their token (`release_ms`, issue 48;
0.1-0.2 ms on the CPU, which does not overlap).
"""
from __future__ import annotations

import threading
from typing import Sequence

from ..llama import DecodeError
from .failures import Failures
from .published import Published
from .request import Request
from .scheduler import Scheduler, Step
from .seams import Runner


class Stepping:
    """Runs steps (`run`) and counts them (`count`); `arrival` is set by a submission from any
    thread and cleared by the engine each round: a preemptible step in flight is then aborted."""

    def __init__(self, scheduler: Scheduler, runner: Runner, failures: Failures, published: Published) -> None:
        self.scheduler, self.runner, self.failures, self.published = scheduler, runner, failures, published
        self.count = 0
        # a step of long prefill chunks is cut short when a newcomer that gains arrives, so its
        # first token does not wait for the rest of the step (`arrived`)
        self._preemptible = False
        self.arrival = threading.Event()
        runner.set_abort(lambda: self._preemptible and self.arrival.is_set())

    def arrived(self, requests: Sequence[Request]) -> None:
        """Requests were submitted (any thread): a step in flight that is preemptible is cut short
        if one of them gains (StepPolicy.newcomer_gains: its whole prompt fits the next step; a
        compressed one goes to the compressor first)."""
        policy = self.scheduler.steps.policy
        if any(r.compression is None and policy.newcomer_gains(len(r.prompt_tokens)) for r in requests):
            self.arrival.set()

    def run(self, step: Step) -> None:
        """One step, counted once it has run (whatever became of it)."""
        self._run(step)
        self.count += 1

    def _run(self, step: Step) -> None:
        """Launch the step's decode; where it runs beside the host (a GPU), release the last step's
        text and events meanwhile, or before the launch where the launch itself would wait for
        most of the step (runner.returns_early); then take its tokens, a first token's text out at once."""
        steps = self.scheduler.steps
        beside = self.runner.returns_early(step)
        if self.runner.overlaps and not beside:
            self.release_last()  # a short request's first token would wait out a long chunk's ubatches
        self._preemptible = steps.preemptible(step)
        self.runner.arm_abort(self._preemptible)
        steps.started(step)
        try:
            self.runner.launch(step)
        except DecodeError as error:
            if error.code == 2 and self._preemptible and self.arrival.is_set():
                steps.preempted(step, self.runner.kv_tokens)  # for a newcomer: it goes next step
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
        if self.runner.overlaps and self.scheduler.intake.fresh:  # not after the next round's admissions and launch
            self.release_last(fresh_only=True)

    def release_last(self, fresh_only: bool = False) -> None:
        """Where the runner overlaps: the last step's text and events, after the stats (built again
        only where this round's are stale); `fresh_only`: of the requests that got their first token."""
        self.scheduler.release_text(fresh_only)
        if self.published.stale():
            self.published.stats_now(self.count)
        self.scheduler.emit()

"""What an engine publishes for other threads: the activity background work reads (step_policy.Flags)
and the stats /status and /metrics read (a frozen `SchedulerStats`), each replaced whole on the
engine thread, so readers need no lock."""
from __future__ import annotations

from dataclasses import replace

from .scheduler import Scheduler
from .seams import Activity
from .stats import SchedulerStats


class Published:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.activity = Activity()
        self.stats: SchedulerStats = scheduler.stats()  # replaced whole, never changed: read without a lock
        self._live: int | None = None  # live requests when this round's stats were built; None: not yet

    def new_round(self) -> None:
        self._live = None

    def activity_now(self) -> None:
        self.activity.publish(self.scheduler.steps.flags(self.scheduler.running))

    def stats_now(self, steps: int) -> None:
        """Once a round in a busy stretch: after the step (and before it only when events go out
        first, or when there is no step); where the runner overlaps, before the step's launch when
        events go out first, else beside its decode."""
        self.stats = replace(self.scheduler.stats(), steps=steps)
        self._live = len(self.scheduler.live)

    def stale(self) -> bool:
        """Whether the stats must be built again: none were this round, or a request has ended since
        (a stop string in the released text, a client cut off by the events sent). Between the
        round's build and the decode's window nothing else the stats show changes (the compression
        progress, which another thread moves, stays as of that build)."""
        return self._live != len(self.scheduler.live)

"""What a model can ever serve, and how many live requests it holds: the checks admission makes
before a request is queued (the server answers each refusal in its own way)."""
from __future__ import annotations

from .prefix_cache import PrefixCache
from .request import ErrorKind, Request


class AdmissionError(Exception):
    """Requests refused before they run, and why (the server answers each kind in its own way)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message

    @classmethod
    def unavailable(cls, reason: str) -> AdmissionError:
        """The model takes no requests now (failed, stalled, SHUTTING_DOWN)."""
        return cls(ErrorKind.UNAVAILABLE, reason)


class Limits:
    """SchedulerConfig's limits over the KV the prefix cache accounts for."""

    def __init__(self, cache: PrefixCache, n_slots: int, max_ctx: int, max_queue: int) -> None:
        self.cache, self.n_slots, self.max_ctx, self.max_queue = cache, n_slots, max_ctx, max_queue

    @property
    def capacity(self) -> int:
        """Live requests (running, queued, compressing) the engine holds at most: slots + max_queue."""
        return self.n_slots + self.max_queue

    def check(self, *requests: Request) -> None:
        """Refuse what can never be served, whatever the load (INVALID, TOO_LONG). Reads only fixed
        limits, so any thread may call it."""
        if len(requests) > self.capacity:
            raise AdmissionError(
                ErrorKind.INVALID,
                f"{len(requests)} choices can never be served together: this model runs "
                f"{self.n_slots} at once (max_concurrency) and queues {self.max_queue} more (max_queue)",
            )
        for request in requests:
            self._check_fits(request)

    def check_room(self, live: int, n_new: int) -> None:
        """Refuse `n_new` requests for load (BUSY) where `live` ones are held already."""
        if live + n_new > self.capacity:
            raise AdmissionError(
                ErrorKind.BUSY,
                f"no room for {n_new} more request(s): {live} are running or queued, of "
                f"{self.capacity} ({self.n_slots} slots + max_queue {self.max_queue}); retry later",
            )

    def _check_fits(self, request: Request) -> None:
        n_prompt = len(request.prompt_tokens)
        if n_prompt == 0:
            raise AdmissionError(ErrorKind.INVALID, "the prompt is empty")
        if n_prompt + request.params.max_tokens > self.max_ctx:
            raise AdmissionError(
                ErrorKind.TOO_LONG,
                f"prompt ({n_prompt} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{n_prompt + request.params.max_tokens} exceeds the context limit max_ctx "
                f"({self.max_ctx} tokens)",
            )
        capacity = self.cache.slot_capacity
        if self.cache.pages_for(request.reserve_tokens) * self.cache.page_size > capacity:
            where = "a slot's KV stream holds" if self.cache.per_slot else "the KV pool holds"
            raise AdmissionError(
                ErrorKind.TOO_LONG,
                f"the request needs {request.reserve_tokens} KV tokens (prompt + max_tokens), {where} {capacity}",
            )

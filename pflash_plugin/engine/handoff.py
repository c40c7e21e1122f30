"""Queued requests that asked for compression: handed to the compression thread, or prefilled in
full (or over the compressed cells of an earlier turn they extend) where drafting would not pay,
and queued again ahead of new arrivals when their compression comes back.
"""
from __future__ import annotations

from typing import Callable

from .admission import RequestQueue
from .media_prompt import relocated
from .prefix_cache import PrefixCache, Slot
from .request import CompressionJob, Report, Request, RequestStatus


class CompressionHandoff:
    """The requests on the compression thread (`compressing`) and those handed off since the
    engine last took them. `can_compress` and `reuse_compressed` are SchedulerConfig's."""

    def __init__(self, queue: RequestQueue, cache: PrefixCache, clock: Callable[[], float],
                 can_compress: bool, reuse_compressed: bool) -> None:
        self.queue, self.cache, self.clock = queue, cache, clock
        self.can_compress, self.reuse_turns = can_compress, can_compress and reuse_compressed
        self.compressing: list[Request] = []
        self._handed: list[Request] = []  # handed off, for the engine to give to its compressor

    def hand_off(self) -> None:
        """Hand off waiting requests that asked for compression, unless the prefix cache already
        holds most of the prompt (measured here: the compression thread never reads the cache)."""
        for request in [r for r in self.queue.waiting if r.compression is not None]:
            assert request.compression is not None
            extended = self.cache.compressed_source(request.prompt_tokens) if self.reuse_turns else None
            if extended is not None:
                self._reuse_compressed(request, extended)
                continue
            reuse = self.cache.cached_prefix(request.prompt_tokens)
            if not self.can_compress or reuse * 2 >= len(request.prompt_tokens):
                if self.can_compress:
                    request.pflash = request.compression.skipped(f"{reuse} prompt tokens are cached", "cached")
                else:
                    request.pflash = request.compression.skipped("no compressor", "no_compressor")
                request.compression = None
                continue
            self.queue.remove(request)
            request.status = RequestStatus.COMPRESSING
            request.timings.handed = self.clock()
            self.compressing.append(request)
            self._handed.append(request)

    def _reuse_compressed(self, request: Request, slot: Slot) -> None:
        """Prefill the compressed prompt `slot` caches in place of the original it extends, then the
        rest of `request`'s prompt: the cached cells serve again and nothing is drafted."""
        assert slot.source is not None and request.compression is not None
        n_source = len(slot.source)
        request.prefill_tokens = slot.tokens[:slot.source_len] + request.prompt_tokens[n_source:]
        request.media = relocated(request.media, request.prefill_tokens)
        request.pflash = request.compression.skipped(
            f"extends a prompt compressed earlier: its first {n_source} tokens reuse the {slot.source_len} "
            "cached cells of its compressed form", "extends_compressed")
        request.compression = None

    def take_handed(self) -> list[Request]:
        """The requests handed off since the last call, for the engine's compressor."""
        handed, self._handed = self._handed, []
        return handed

    def resume(self, request: Request, tokens: list[int], report: Report) -> None:
        """A compression came back: queue the (maybe compressed) prompt ahead of new arrivals."""
        if request.status is not RequestStatus.COMPRESSING:
            return  # finished meanwhile (cancelled): the late result is dropped
        self.compressing.remove(request)
        request.timings.resumed = self.clock()
        request.compression = None
        request.prefill_tokens = list(tokens)
        request.media = relocated(request.media, request.prefill_tokens)  # media runs kept whole, moved
        request.pflash = report
        request.status = RequestStatus.WAITING
        self.queue.add(request, prepared=True)

    def drop(self, request: Request) -> None:
        """A compressing request ended: its job is cancelled unless another sample still waits for it."""
        self.compressing.remove(request)
        assert request.compression is not None
        if not any(other.compression is request.compression for other in self.compressing):
            request.compression.cancelled.set()  # no sample waits for it: the worker drops it at its next chunk


def shared_jobs(handed: list[Request]) -> list[tuple[CompressionJob, list[Request]]]:
    """The jobs of the handed-off requests, each with the requests that share it (the n samples of
    one prompt): it runs once, and its result goes to each."""
    sharing: dict[int, tuple[CompressionJob, list[Request]]] = {}
    for request in handed:
        assert request.compression is not None
        sharing.setdefault(id(request.compression), (request.compression, []))[1].append(request)
    return list(sharing.values())

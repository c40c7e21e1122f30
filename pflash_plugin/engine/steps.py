"""A step's rows from the step policy's plan (step_policy.py): the mechanism between the running
requests, their slots' KV and the batch a runner decodes.

Where `Steps.steady` is set (a KV stream per slot: engine/loader.py), a decode step's slots
are one run, and keep the last step's while its rows end: an idle slot among them gets a filler row
(a real row's token, one cell past its KV; its logits unread) whose write the scheduler drops, as
for any row of a request that ended (Scheduler.update). With a KV stream per slot, llama.cpp puts
only consecutive sequences in one ubatch (llama_batch_allocr::split_equal, `sequential`): 40 rows
left among 64 slots by answers that ended at random decoded as a dozen ubatches, each reading all
the weights, and their alternating shapes defeat graph reuse (llm_graph_params::allow_reuse), so
ggml-cuda ran each kernel by kernel (docs/speculation.md). Filler rows cost a GPU little beside a
step's own (the weights are read once a ubatch), and the CPU little where they ask for no logits
(`filler_logits`, off there: docs/sampling.md); the last step's shape is let go when fewer than
half of its rows are real, for the run between the first and last real rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from .live_text import LiveText
from .media_prompt import MediaRows, mrope_partial, piece_left, prefill_piece, span_at
from .positions import kv_position, position
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus, SamplingParams, TokenOutput
from .stats import SpeculationStats
from .step_policy import Flags, Seat, StepPolicy, flags

if TYPE_CHECKING:
    from .speculation.drafting import Speculation


@dataclass
class BatchItem:
    request: Request
    tokens: list[int]
    start_pos: int  # its first token's position (positions.py); a media piece's are `media.positions`
    wants_logits: bool
    drafts: int = 0  # the last tokens are drafts, each with its logits (speculative decoding)
    media: MediaRows | None = None  # a media piece: `tokens` are its pseudo-ids, `media.rows` what is decoded
    filler: bool = False  # the slot of an ended request, decoded to keep the step's shape (Steps.steady)


@dataclass
class Step:
    items: list[BatchItem]

    @property
    def n_tokens(self) -> int:
        return sum(len(item.tokens) for item in self.items)


class Steps:
    """Composes steps by `policy` over the slots of `cache`; `text` counts the steps a prompt is
    left out of; `speculation` (set by whoever builds the engine) drafts tokens for decode rows."""

    def __init__(self, policy: StepPolicy, cache: PrefixCache, text: LiveText) -> None:
        self.policy, self.cache, self.text = policy, cache, text
        self.speculation: Speculation | None = None
        self.steady = False  # decode steps' slots one run, kept while rows end (filler rows; module docstring)
        # a decode step's filler rows ask for logits: on a GPU the step keeps its outputs and so its CUDA
        # graph; on the CPU each would cost its row of the output projection (8 ms at the demo's 262K)
        self.filler_logits = True
        self._shape: set[int] = set()  # the last decode step's slots, fillers' included
        self._stand_ins: dict[int, Request] = {}  # each slot's filler rows' request (one that has ended)

    def compose(self, running: Sequence[Request]) -> Step:
        """The step the policy plans for the running requests: a decode row each, prefill chunks."""
        slots = self.cache.slots
        plan = self.policy.plan(self.seats(running))
        room = self.policy.max_batch_tokens - len(plan.decode) - sum(n for _, n in plan.chunks)
        drafts = self.speculation.drafts(running, plan.decode, room, bool(plan.chunks)) if self.speculation else {}
        # a row's position: its first token's index in the slot, less an M-RoPE image's cells (positions.py)
        items = [BatchItem(r, [r.output_tokens[-1], *drafts.get(r.request_id, ())],
                           position(r.media, len(slots[r.held_slot].tokens)), True, len(drafts.get(r.request_id, ())))
                 for r in plan.decode]
        for request, n in plan.chunks:
            start, at = request.n_prefilled, position(request.media, len(slots[request.held_slot].tokens))
            piece = prefill_piece(request.media, start, n)  # cut at media edges (media_prompt.py)
            if piece is None:  # its media is still encoding: it sits this step out
                continue
            n, media = piece
            items.append(BatchItem(request, request.prefill_tokens[start : start + n], at, n == request.prefill_left,
                                   media=media))
        items += self._text_after_media(items)
        for request in plan.left_out:
            self.text.left_out(request)
        # in slot order: llama.cpp puts a run of consecutive sequences in one ubatch when each slot
        # has a KV stream of its own, and any order serves a unified one
        return Step(sorted(self._steady(items), key=lambda item: item.request.held_slot))

    def _text_after_media(self, items: list[BatchItem]) -> list[BatchItem]:
        """For each media piece that ends its image, the prompt's text after it (to the next media
        edge or the prompt's end) in the same step's token batch, where the batch has room: the
        media calls run before the token batch, so its rows follow the image's cells in the slot as
        the next step's would. The image's first token comes a step sooner, and its slot has a row
        in the token batch where the decode rows' run would otherwise break around it (with a KV
        stream per slot llama.cpp makes a ubatch per run of consecutive slots: module docstring),
        and the step after is one of decode rows alone (32 image chats in the GPU's order on the
        CPU: bench/vision_steps.py)."""
        room = self.policy.max_batch_tokens - sum(len(item.tokens) for item in items if item.media is None)
        out: list[BatchItem] = []
        for item in items:
            request, n = item.request, len(item.tokens)
            start, left = request.n_prefilled + n, request.prefill_left - n
            if item.media is None or room <= 0 or left <= 0 or span_at(request.media, start) is not None:
                continue  # text, no room, the prompt's end, the image not ended or another one next
            piece = prefill_piece(request.media, start, min(room, left))
            if piece is None or piece[1] is not None:
                continue
            index = len(self.cache.slots[request.held_slot].tokens) + n  # after the image's cells
            out.append(BatchItem(request, request.prefill_tokens[start : start + piece[0]],
                                 position(request.media, index), piece[0] == left))
            room -= piece[0]
        return out

    def _steady(self, items: list[BatchItem]) -> list[BatchItem]:
        """A decode step's rows plus a filler row for each idle slot between them (a GPU reads the
        weights once a ubatch: 2 runs of rows cost about what 64 rows in one do), and for each slot
        of the last decode step whose request ended since, while at least half of that shape is real
        (module docstring): where `steady` is set and every row decodes one token. A slot that
        cannot take one (held by a request not in the step, a stream copy pending, full) stays a gap."""
        last, self._shape = self._shape, set()
        if not self.steady or self.speculation is not None or not items:
            return items
        if not all(item.request.status is RequestStatus.DECODING and len(item.tokens) == 1 for item in items):
            return items + self._bridges(items)
        real = {item.request.held_slot for item in items}
        span = set(range(min(real), max(real) + 1))
        if real <= last and 2 * len(real) >= len(last):
            span |= last
        token = items[0].tokens[0]
        gaps = [index for index in sorted(span - real) if self._fills(index)]
        fillers = [self._filler(index, token, self.filler_logits) for index in gaps]
        self._shape = real | {item.request.held_slot for item in fillers}
        return items + fillers

    def _bridges(self, items: list[BatchItem]) -> list[BatchItem]:
        """A mixed step's filler rows (prefill chunks or media pieces beside its decode rows): one
        for each slot between its token batch's first and last rows that has no row there, so the
        decode rows stay one run: an idle slot, one held by a request sitting the step out at a text
        position (its image's embeddings or the step's budget not there yet), or one whose image
        piece does not end the image (its row after the piece's cells). 32 image chats in the GPU's
        order left such gaps in a third of their media steps, a ubatch more each
        (bench/vision_steps.py). A filler's write is dropped after the step, a held slot's too
        (Scheduler.update, after the piece's tokens are kept; unpad). No logits: a held slot's
        sampler (a device chain samples every output row of its sequence) never sees it."""
        rows = [item for item in items if item.media is None]
        if not rows:
            return []
        pieces = {item.request.held_slot: item for item in items if item.media is not None}
        real = {item.request.held_slot for item in rows}
        out, token = [], rows[0].tokens[0]
        for index in sorted(set(range(min(real), max(real) + 1)) - real):
            piece = pieces.get(index)
            if piece is None:
                if self._fills(index, held=True):
                    out.append(self._filler(index, token, logits=False))
            elif (at := self._after_piece(piece)) is not None:
                out.append(self._filler(index, token, logits=False, at=at))
        return out[: max(self.policy.max_batch_tokens - sum(len(item.tokens) for item in rows), 0)]

    def _after_piece(self, piece: BatchItem) -> int | None:
        """The position a filler row takes after a media piece that leaves its image unfinished:
        None for an M-RoPE image (its cells share one KV position: the filler's drop would drop
        them) or a slot without a cell to spare."""
        request, n = piece.request, len(piece.tokens)
        slot = self.cache.slots[request.held_slot]
        if _in_mrope_image(request) or self.cache.copying(slot) or len(slot.tokens) + n >= self.cache.slot_capacity:
            return None
        return position(request.media, len(slot.tokens) + n)

    def _fills(self, index: int, held: bool = False) -> bool:
        """Whether an idle slot can decode a filler row: a cell past its tokens in its own stream;
        `held`: also a slot whose request is not inside an M-RoPE image (whose cells share one KV
        position: dropping the filler would drop them)."""
        slot = self.cache.slots[index]
        request = slot.request
        free = request is None or (held and not _in_mrope_image(request))
        return free and not self.cache.copying(slot) and len(slot.tokens) < self.cache.slot_capacity

    def _filler(self, index: int, token: int, logits: bool = True, at: int | None = None) -> BatchItem:
        """A filler row for the slot: `token` (a real row's: a slot's last cell may be an image's
        pseudo-id) one past its KV (or `at`), for a stand-in request that has ended (nothing samples it;
        Scheduler.update drops its write)."""
        tokens, stand_in = self.cache.slots[index].tokens, self._stand_ins.get(index)
        if stand_in is None:
            stand_in = self._stand_ins[index] = Request([token], SamplingParams(max_tokens=1))
            stand_in.status, stand_in.slot = RequestStatus.FINISHED_CANCELLED, index
        return BatchItem(stand_in, [token], kv_position(tokens, len(tokens)) if at is None else at, logits, filler=True)

    def unpad(self, step: Step) -> None:
        """What a failed step's filler rows may have written, dropped (a step that ran drops it in
        Scheduler.update, as for any row of a request that ended)."""
        for item in step.items:
            if item.filler:  # an idle slot's, or a held one's (_bridges): past the slot's tokens
                self.cache.trim(self.cache.slots[item.request.held_slot])

    def seats(self, running: Sequence[Request]) -> list[Seat[Request]]:
        """The running requests as the step policy sees them."""
        return [Seat(r, r.status is RequestStatus.DECODING, r.prefill_left, self.text.starved(r),
                     r.timings.first_token is None, piece_left(r.media, r.n_prefilled)) for r in running]

    def flags(self, running: Sequence[Request]) -> Flags:
        """What background work is told now, from the requests the steps serve (step_policy.flags)."""
        return flags(self.seats(running), self.policy.max_batch_tokens)

    def keep(self, item: BatchItem, out: TokenOutput | Exception | None) -> None:
        """A row decoded: its tokens go into its slot, but drafts the target rejected, whose KV
        cells are removed (so the slot's tokens stay what its KV holds: the prefix cache exact)."""
        slot = self.cache.slots[item.request.held_slot]
        kept = len(item.tokens) - item.drafts + (len(out.accepted) if isinstance(out, TokenOutput) else 0)
        slot.tokens.extend(item.tokens[:kept])
        if kept < len(item.tokens):
            self.cache.trim(slot)

    def started(self, step: Step) -> None:
        """The step is about to run (Speculation.started)."""
        if self.speculation:
            self.speculation.started(step)

    def verified(self, step: Step, outputs: Mapping[int, TokenOutput | Exception]) -> None:
        """The step's rows were sampled (Speculation.verified)."""
        if self.speculation:
            self.speculation.verified(step, outputs)

    def speculation_stats(self) -> SpeculationStats | None:
        return self.speculation.stats() if self.speculation else None

    def preemptible(self, step: Step) -> bool:
        """A step worth aborting for a newcomer (StepPolicy.preemptible): its prefill chunks. Never
        a step with media pieces: its embedding calls land before its token batch, whose abort
        (on a GPU at its first poll) would roll them back to be decoded again (`preempted`): 144 ms
        of an H200's 2048 rows, 9-40% more rows decoded at 32 image chats on the CPU."""
        if any(item.media is not None for item in step.items):
            return False
        return self.policy.preemptible([len(item.tokens) for item in step.items
                                        if item.request.status is RequestStatus.PREFILLING])

    def preempted(self, step: Step, kv_tokens: Callable[[int], int]) -> None:
        """The step was aborted for a newcomer: llama.cpp kept the ubatches it computed before the
        abort, so what they hold of each text prompt's chunk stays prefilled (`kv_tokens(slot)`: the
        slot's KV cells now), less a last token whose logits the abort lost; the rest is rolled back
        and redone: decode rows (their tokens were not sampled), media prompts (positions.py), and a
        prompt that had prefilled nothing into its slot, which may still lend it to the newcomer
        (lending.py; mix8's fourth short chat waited for a slot otherwise: seconds, not a step). It
        is not counted as left out: aged, a prompt shorter than a step plus `aging` would go ahead of
        the newcomer it was cut for."""
        for item in step.items:
            request = item.request
            if (request.status is not RequestStatus.PREFILLING or request.media
                    or request.n_prefilled == request.cached_tokens):
                continue
            slot = self.cache.slots[request.held_slot]
            landed = min(kv_tokens(slot.index) - len(slot.tokens), len(item.tokens) - item.wants_logits)
            if landed > 0:
                slot.tokens.extend(item.tokens[:landed])
                request.n_prefilled += landed
        self.rollback(step)

    def rollback(self, step: Step) -> None:
        """A decode was aborted: drop whatever it wrote past each slot's known tokens (earlier
        ubatches of a multi-ubatch step may have landed) so the step can be redone. A prefill
        inside an M-RoPE image goes back to the image's start: its cells share one KV position,
        so what the step wrote of it is removed only with the rest of it (positions.py)."""
        self.cache.decoded()
        for item in step.items:
            request, slot = item.request, self.cache.slots[item.request.held_slot]
            image = mrope_partial(request.media, request.n_prefilled) if item.media is not None else None
            if image is not None and len(slot.tokens) == request.n_prefilled:  # the slot holds its prefill
                del slot.tokens[image.start :]
                request.n_prefilled = image.start
            self.cache.trim(slot)


def _in_mrope_image(request: Request) -> bool:
    """Whether the request's next prompt token is an M-RoPE image's (positions.py)."""
    span = span_at(request.media, request.n_prefilled) if request.media else None
    return span is not None and span.chunk.mrope_image

"""The split of the device between decoding, prefilling and drafting: one pure rule over the
running requests, with nothing of llama.cpp in it, so a test drives it with plain values.

Each step decodes one token for every generating request (up to the step's tokens), then fills the
rest with prefill chunks: shortest remaining prefill first, aged so a long prompt gets through a
steady stream of short ones (once aged past the step's budget, it takes what the prompts finishing
in the step leave); while requests decode, the prefill may be capped at `prefill_chunk` per prompt
prefilling, or at `prefill_chunk` in all where `chunk_per_step` (the CPU's), so decode steps stay
short (while few answers decode the cap may grow to `prefill_per_answer` over their number);
prompts that finish their prefill in this step go alone, so a long chunk never delays their first
token (short ones, up to `preempt_chunk`, go first, and other chunks only fill the step up to
that). A prompt prefilling alone gets the whole step. On the CPU a step's time grows with its
prefill tokens, whoever they belong to: per prompt, a request decoding beside 3 long prompts (demo
model, 2 cores) had steps of 384 and 256 prefill tokens, each its inter-token latency
(bench/online_steps.py, docs/online.md). A GPU's explicit cap stays per prompt, as measured there
(a step of 2,048 tokens costs it little more than one of 512: loader.step_chunks).

A step whose prefill chunks together pass `preempt_chunk` (one prompt or several, beside decode
rows or not) is cut short by a newcomer whose whole prompt fits a step (`newcomer_gains`): its
first token then comes from the next step instead of after the rest of the step in flight (on the
CPU with the H200's step shape, short requests sent 100 ms apart beside long prompts: engine TTFT
p90 186 -> 21 ms, docs/first_token_cpu.md). What the cut step's computed ubatches wrote of each
prompt under way stays (engine/steps.py `preempted`), so the cut costs the long prompts the aborted
ubatch at most (on a GPU not even that: llama.cpp polls
before launching it); the newcomer's step goes first, then their chunks resume. A shrinking prefill
budget (Sarathi, vLLM's chunked prefill) cannot do this: the step in flight was composed before the
newcomer came, and capping every step for arrivals that may come cost mix8/qa8/cd4 3-28% on the
H200 (loader.step_chunks).

Requests that reach the engine in one round (arrived together, while a step ran) are admitted
shortest prompt first: their arrival order within the round says nothing, and free slots given to
the short ones start them at once, where a long prompt ahead would hold its slot for its whole
prefill (8 requests at once, 4 slots: mix8's short chats waited 1.7 s on an H200 behind the long
ones that reached the slots first). Earlier rounds still go first, so nothing starves.

What background work (PFlash drafting, pflash/pacing.py) is told comes from the same requests
(`Flags`): it steps aside only for a request that holds a slot and awaits its first token, since
only those gain from the device. A request queued for a slot (behind slots that decode) waits
for a slot, not for the device: a draft that stepped aside for it would stall for nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, NamedTuple, Sequence, TypeVar

K = TypeVar("K")
M = TypeVar("M")


class Seat(NamedTuple, Generic[K]):
    """One request holding a slot, as the policy sees it (`key` names it to the caller). A named
    tuple: the scheduler makes one per running request twice a step, and a frozen dataclass costs
    twice as much to make (1.3 µs against 0.7 here)."""

    key: K
    decoding: bool  # generating (else prefilling)
    prefill_left: int  # prompt tokens still to prefill
    starved: int = 0  # steps it was left out of while prefilling (aging)
    first_token_due: bool = False  # it has not had its first token yet
    piece_left: int = 0  # tokens to its prompt's next media edge, where a chunk ends (0: none; issue 46)


@dataclass(frozen=True)
class Plan(Generic[K]):
    """What one step runs: a decode row each, prefill chunks of so many tokens, and the prompts
    prefilling that it leaves out (they age)."""

    decode: tuple[K, ...]
    chunks: tuple[tuple[K, int], ...]
    left_out: tuple[K, ...]


@dataclass(frozen=True)
class Flags:
    """What the engine tells background work each round (engine.seams.Activity publishes it)."""

    interactive_waiting: bool = False  # a request with a slot awaits its first token: step aside
    slots_decoding: bool = False  # slots generate: share the device (short chunks, a duty cycle)
    # a request's first token comes from the next step (the rest of its prompt fits it): a large request's
    # preparation waits, its Python beside the engine thread's (server/runtime/polite.py)
    first_token_next: bool = False


@dataclass(frozen=True)
class StepPolicy:
    """The step's limits (SchedulerConfig's)."""

    max_batch_tokens: int  # tokens of one step
    prefill_chunk: int | None = None  # prefill tokens per prompt prefilling while others decode (None: no cap)
    aging: int = 128  # each step a prompt is left out of counts as this many fewer tokens left
    preempt_chunk: int | None = None  # a step prefilling past this many tokens is cut short for a newcomer
    chunk_per_step: bool = False  # prefill_chunk caps the step's prefill in all, however many prompts prefill
    prefill_per_answer: int = 0  # while few answers decode, the cap grows to this many tokens over their number

    def prefill_cap(self, decoding: int) -> int:
        """The prefill cap (per prompt, or per step where chunk_per_step) beside `decoding` answers:
        `prefill_chunk`, or more while few decode: a step's decode rows cost a GPU about as much for
        one answer as for several, so each chunk a long prompt is cut into costs its first token a
        step for the sake of few tokens, and a longer step's time falls on few answers."""
        return max(self.prefill_chunk or 0, self.prefill_per_answer // max(decoding, 1))

    def urgency(self, seat: Seat[K]) -> int:
        """Tokens left to prefill, fewer for every step the prompt was left out of."""
        return seat.prefill_left - self.aging * seat.starved

    def plan(self, seats: Sequence[Seat[K]]) -> Plan[K]:
        """Compose one step from the running requests, in their order (ties keep it)."""
        decode = tuple(s.key for s in seats if s.decoding)[: max(self.max_batch_tokens, 0)]
        budget = self.max_batch_tokens - len(decode)
        # shortest remaining prefill first (a short prompt beside a long one starts at once), aged
        prefilling = sorted((s for s in seats if not s.decoding), key=self.urgency)
        if decode and self.prefill_chunk:  # others are decoding: keep their steps short
            budget = min(budget, self.prefill_cap(len(decode)) * (1 if self.chunk_per_step else len(prefilling)))
        # those that finish their prefill now go alone (a long chunk would delay their first token), but
        # for prompts aged as if they did, which take what they leave: first, an aged prompt kept the
        # whole budget of every step for the rest of its prefill ahead of them
        due = [s for s in prefilling if self.urgency(s) <= budget]
        queue = [s for s in due if s.prefill_left <= budget] + [s for s in due if s.prefill_left > budget]
        queue, budget = self.short_first(queue or prefilling, budget)
        chunks: list[tuple[K, int]] = []
        for seat in queue:
            if budget <= 0:
                break
            n = min(budget, seat.piece_left or seat.prefill_left)  # the rest goes to the next prompt
            chunks.append((seat.key, n))
            budget -= n
        served = queue[: len(chunks)]
        left_out = tuple(s.key for s in prefilling if all(s is not t for t in served))
        return Plan(decode, tuple(chunks), left_out)

    def short_first(self, queue: list[Seat[K]], budget: int) -> tuple[list[Seat[K]], int]:
        """Where the step finishes short prompts (none over `preempt_chunk`: those a newcomer's cut is
        for), they go first and the step's other chunks (another prompt's last long chunk, an aged
        prompt) only fill it up to `preempt_chunk`: beside them a whole budget's chunk would delay
        their first tokens by its time (2 CPU cores: a 3-word request sent while a ~900-token prompt
        prefilled alone, 512 tokens a step, had its first token in up to 1.10 s, 0.63 with this
        bound; 10 interleaved reps). Short prompts together keep the whole budget."""
        if not self.preempt_chunk:
            return queue, budget
        bound = min(budget, self.preempt_chunk)
        short = [s for s in queue if s.prefill_left <= bound]
        if not short:
            return queue, budget
        rest = [s for s in queue if s.prefill_left > bound]
        return short + rest, min(budget, max(sum(s.prefill_left for s in short), self.preempt_chunk))

    def preemptible(self, prefill_chunks: Sequence[int]) -> bool:
        """A step worth cutting short for a newcomer: its prefill chunks (of one prompt or several;
        its decode rows aside) together more than a newcomer should wait for (`preempt_chunk`;
        None: never)."""
        chunk = self.preempt_chunk
        return chunk is not None and sum(prefill_chunks) > chunk

    def newcomer_gains(self, prompt_tokens: int) -> bool:
        """A newcomer worth cutting a step short for: the next step prefills its whole prompt, so
        its first token comes a step after the cut. A longer one would still wait for prompts
        ahead of it, and its cut would only re-launch the step."""
        return self.preempt_chunk is not None and prompt_tokens <= self.max_batch_tokens


def flags(seats: Sequence[Seat[K]], step_tokens: int = 0) -> Flags:
    """What background work is told about these running requests (queued ones count for nothing:
    they wait for a slot, which the device does not give them sooner); `step_tokens`: a step's."""
    return Flags(interactive_waiting=any(s.first_token_due for s in seats),
                 slots_decoding=any(s.decoding for s in seats),
                 first_token_next=any(s.first_token_due and s.prefill_left <= step_tokens for s in seats))


def arrival_order(messages: Sequence[M], prompt_tokens: Callable[[M], int | None]) -> list[M]:
    """The messages of one round in the order to apply them: each run of consecutive submissions
    (`prompt_tokens` not None) shortest prompt first, ties in arrival order; any other message
    (None: a cancellation, a compression result, a shutdown) stays where it is between them."""
    def shortest_first(run: list[M]) -> list[M]:
        return sorted(run, key=lambda message: prompt_tokens(message) or 0)

    ordered: list[M] = []
    run: list[M] = []
    for message in messages:
        if prompt_tokens(message) is None:
            ordered += shortest_first(run) + [message]
            run = []
        else:
            run.append(message)
    return ordered + shortest_first(run)

"""Per-request PFlash planning, on the request's own thread before it reaches the engine: a job
for the compression thread, or a report saying why the prompt is not compressed, or neither (PFlash
is off and the request did not ask). Deciding here keeps short prompts out of the compression
queue, where they would wait behind long scorings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..llama import Model
from .compressor import CompressionJob, PflashConfig
from .query import plan_query
from .report import MANDATORY_OVER_BUDGET, PflashReport
from .selection import budget_for

MAX_EXPLICIT_QUERY = 256  # tokens of a request's pflash.query (the drafter context leaves room)
NOT_ENABLED = "PFlash is not enabled on this model (start it with --pflash auto)"


class PlanError(ValueError):
    """The request's PFlash options are unusable; `param` names the field (the server's 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Ask(Protocol):
    """What one request asks of PFlash (the server's `pflash` request field)."""

    @property
    def mode(self) -> str | None: ...  # off | auto | always; None: the model's mode
    @property
    def keep_ratio(self) -> float | None: ...
    @property
    def query(self) -> str | None: ...  # text whose tokens score the prompt


@dataclass(frozen=True)
class PromptFacts:
    """What the prompt's rendering knows beyond its tokens."""

    last_user: str | None = None  # the final user message: the query
    system: str | None = None  # the system prompt: always kept
    has_tools: bool = False
    json_format: bool = False
    fill_in: bool = False  # a fill-in-the-middle prompt: its FIM tokens sit mid-prompt, where a cut could drop them


@dataclass(frozen=True)
class Plan:
    """What the engine request carries: `compression` = job, `pflash` = report."""

    job: CompressionJob | None = None  # compress: the job for the compression thread
    report: PflashReport | None = None  # not compressed: why (neither: nothing to report)


class Planner:
    """Plans the requests of one model; `enabled`: the model has a compression thread."""

    def __init__(self, config: PflashConfig, model: Model, enabled: bool) -> None:
        self.config, self.model, self.enabled = config, model, enabled

    def plan(self, tokens: list[int], ask: Ask | None, facts: PromptFacts = PromptFacts()) -> Plan:
        """A job to run, or a `skipped` report saying why not, or neither. Raises PlanError."""
        n = len(tokens)
        mode = ask.mode if ask else None
        skip = skip_reason(self.config, n, mode, facts.has_tools, facts.json_format, facts.fill_in)
        if skip is not None and skip[0] == "off" and mode is None:
            return Plan()  # PFlash is off and the request did not ask: report nothing
        if skip is None and not self.enabled:
            skip = ("not_enabled", NOT_ENABLED)
        if skip is not None:
            return Plan(report=PflashReport.skipped(n, skip[1], skip[0]))
        ratio = self.config.ratio_for(n, ask.keep_ratio if ask else None)
        if budget_for(n, ratio) >= n:  # a 1-token prompt, a keep ratio of 1: a draft would change nothing
            return Plan(report=PflashReport.skipped(n, f"a keep ratio of {ratio:g} keeps all {n} tokens", "keeps_all"))
        explicit = self._explicit_query(ask.query if ask else None)
        located = facts.system or facts.last_user
        query = plan_query(n, self.config.query_tokens, pieces=self.model.pieces(tokens) if located else None,
                           last_user=facts.last_user, system=facts.system, explicit=explicit,
                           min_head=self.config.segment_min)
        if not query.fits(n, budget_for(n, ratio)):
            return Plan(report=PflashReport.skipped(n, MANDATORY_OVER_BUDGET, "over_budget"))
        return Plan(job=CompressionJob(tokens, query, ratio))

    def _explicit_query(self, query: str | None) -> list[int] | None:
        if not query:
            return None
        explicit = self.model.tokenize(query, add_special=False)
        if len(explicit) > MAX_EXPLICIT_QUERY:
            raise PlanError(f"pflash.query is over {MAX_EXPLICIT_QUERY} tokens", "pflash.query")
        return explicit


def skip_reason(
    config: PflashConfig,
    n_tokens: int,
    mode_override: str | None,
    has_tools: bool = False,
    json_format: bool = False,
    fill_in: bool = False,
) -> tuple[str, str] | None:
    """None when the prompt should be compressed, else why not: (the label /metrics counts it
    under, the reason the report gives).

    Tool calls and JSON output depend on exact prompt details (schemas, examples), and a
    fill-in-the-middle prompt on its FIM tokens between prefix and suffix, which the selection does
    not keep; so they are compressed only when the request itself asks for it.
    """
    mode = mode_override or config.mode
    if mode == "off":
        return "off", "off"
    if (has_tools or json_format) and mode_override is None:
        return "tools_or_json", "tools or a JSON response format (set pflash.mode to compress anyway)"
    if fill_in and mode_override is None:
        return "fill_in_the_middle", "a fill-in-the-middle prompt (set pflash.mode to compress anyway)"
    if mode == "auto" and n_tokens <= config.threshold:
        note = f"; {config.threshold_note}" if config.threshold_note else ""
        return "below_threshold", f"prompt of {n_tokens} tokens is not over the threshold ({config.threshold}{note})"
    return None

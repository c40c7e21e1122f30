"""Thinking split from the answer: the reasoning families' markers (chosen from the chat template,
or by --reasoning_format) and a streaming reader that turns a choice's text into reasoning and
content deltas at O(1) cost per character (it holds back at most a marker's length and a run of
whitespace, never re-reads the text before).

Families (llama.cpp's models/templates): `<think>...</think>` for Qwen3/3.5/3.6, QwQ, DeepSeek R1
and V3.1, GLM 4.5/4.6, Kimi K2 Thinking (and the other templates that write those tags);
`[THINK]...[/THINK]` for Magistral; gpt-oss's harmony channels (harmony.py: analysis is
reasoning). A template whose generation prompt ends inside the block (Qwen3.5 with thinking on,
DeepSeek R1: `...<think>\\n`) makes the model's text start in it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from . import harmony
from .deltas import Delta, ReasoningDelta, TextDelta


@dataclass(frozen=True)
class ThinkTags:
    """One family's markers around its thinking (gpt-oss: its harmony channels)."""

    open: str
    close: str
    channels: bool = False  # harmony: messages on channels, read by harmony.HarmonyReader

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts the model must write for its thinking to be read (Model.render_tokens)."""
        if self.channels:
            return harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.END
        return self.open, self.close


THINK = ThinkTags("<think>", "</think>")
MAGISTRAL = ThinkTags("[THINK]", "[/THINK]")
HARMONY = ThinkTags(harmony.CHANNEL + "analysis" + harmony.MESSAGE, harmony.END, channels=True)


class Reader(Protocol):
    """Reads one choice's text into reasoning and content deltas, streamed."""

    tokens: int  # the reasoning's tokens so far

    def feed(self, text: str, tokens: int = 0) -> list[Delta]:
        """The deltas of the choice's next text (from `tokens` tokens)."""

    def finish(self) -> list[Delta]:
        """The deltas of what was held back, at the end of the text."""


def think_tags(template: str | None) -> ThinkTags | None:
    """The markers the template teaches its model; None: it writes no thinking markers."""
    text = template or ""
    if harmony.CHANNEL in text and harmony.MESSAGE in text:
        return HARMONY
    if MAGISTRAL.close in text:
        return MAGISTRAL
    if THINK.close in text:
        return THINK
    return None


def requested_tags(template_tags: ThinkTags | None, reasoning_format: str) -> ThinkTags | None:
    """The markers read under a reasoning_format: none reads none (the thinking stays content);
    deepseek reads `<think>` tags where the template has no markers, as llama-server does."""
    if reasoning_format == "none":
        return None
    return THINK if template_tags is None and reasoning_format == "deepseek" else template_tags


def opens_in_prompt(tags: ThinkTags, prompt_tail: str) -> bool:
    """Whether the rendered prompt (its end) leaves a thinking block open: its last marker is an
    open one (the generation prompt's `<think>\n`, or a prefill that stops in the middle of one)."""
    return prompt_tail.rfind(tags.open) > prompt_tail.rfind(tags.close)


def reader_for(tags: ThinkTags, prompt_tail: str) -> Reader:
    """The reader of a choice whose prompt ends with `prompt_tail` (the last few tokens' text)."""
    if tags.channels:
        return harmony.HarmonyReader()
    return ReasoningReader(tags, opens_in_prompt(tags, prompt_tail))


def for_template(messages: list[dict], tags: ThinkTags | None) -> list[dict]:
    """Earlier turns' thinking (an assistant message's reasoning_content, which Qwen3's templates
    read) also under the name gpt-oss's template reads, `thinking`."""
    if tags is None or not tags.channels:
        return messages
    return [{**m, "thinking": m["reasoning_content"]} if m.get("role") == "assistant"
            and isinstance(m.get("reasoning_content"), str) else m for m in messages]


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that starts `marker` (shorter than the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningReader:
    """One choice's text in, reasoning and content deltas out. Before the answer's first text the
    reader waits for the open marker (whitespace first allowed); inside the block, reasoning until
    the close marker; after it, content. The reasoning is stripped of the whitespace around it and
    the content of the whitespace after the close marker, as llama-server does."""

    def __init__(self, tags: ThinkTags, inside: bool) -> None:
        """`inside`: the prompt opened the block (a repeated open marker first is skipped)."""
        self.tags, self.inside = tags, inside
        self.state: Literal["start", "reasoning", "content"] = "start"
        self.held = ""  # the start's whitespace and marker prefix, or the end of a possible close marker
        self.space = ""  # the reasoning's trailing whitespace, released when more reasoning follows
        self.began = False  # reasoning text released (its leading whitespace is dropped before)
        self.strip = False  # the content's leading whitespace is dropped (after the close marker)
        self.opened = False  # the text went into a thinking block
        self.tokens = 0  # the reasoning's tokens: of the texts read up to and with the close marker
        self._undecided = 0  # tokens of texts read before the start was known to be reasoning or not

    @property
    def thinking(self) -> bool:
        """Whether the text read so far is still reasoning (or may open it)."""
        return self.state != "content"

    def feed(self, text: str, tokens: int = 0) -> list[Delta]:
        """The deltas of `text`, the next text of the choice; `tokens`: how many tokens it came from."""
        thinking = self.thinking
        out: list[Delta] = []
        while text:
            if self.state == "start":
                text = self._start(text)
            elif self.state == "reasoning":
                text = self._reasoning(text, out)
            else:
                self._content(text, out)
                text = ""
        self._count(thinking, tokens)
        return out

    def _count(self, thinking: bool, tokens: int) -> None:
        """A text's tokens are reasoning when it was read in (or into, or out of) the block."""
        if self.state == "start":
            self._undecided += tokens
        elif thinking and self.opened:
            self.tokens += self._undecided + tokens
            self._undecided = 0

    def finish(self) -> list[Delta]:
        """The end of the text: what was held is released as what it was read as."""
        held, self.held = self.held, ""
        out: list[Delta] = []
        if self.state == "start" and held:
            self.state, self.opened = ("reasoning", True) if self.inside else ("content", False)
        if self.state == "reasoning":
            self._think(held, out)
        elif held:
            self._content(held, out)
        return out

    def _start(self, text: str) -> str:
        """Before anything was released: the text that is left once the state is known."""
        held = self.held + text
        head = held.lstrip()
        if head.startswith(self.tags.open):
            self.held, self.state, self.opened = "", "reasoning", True
            return head[len(self.tags.open):]
        if not head or self.tags.open.startswith(head):
            self.held = held  # whitespace, or the marker's beginning
            return ""
        self.held, self.state, self.opened = "", "reasoning" if self.inside else "content", self.inside
        return held

    def _reasoning(self, text: str, out: list[Delta]) -> str:
        pending = self.held + text
        close = self.tags.close
        at = pending.find(close)
        if at >= 0:
            self.held = ""
            self._think(pending[:at], out)
            self.space, self.state, self.strip = "", "content", True
            return pending[at + len(close):]
        keep = _partial(pending, close)
        self.held = pending[len(pending) - keep:]
        self._think(pending[:len(pending) - keep], out)
        return ""

    def _think(self, text: str, out: list[Delta]) -> None:
        """Reasoning text, its whitespace at either end held back (dropped at the block's ends)."""
        if not self.began:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.space += text
            return
        out.append(ReasoningDelta(self.space + body))
        self.space, self.began = text[len(body):], True

    def _content(self, text: str, out: list[Delta]) -> None:
        if self.strip:
            text = text.lstrip()
            if not text:
                return
            self.strip = False
        out.append(TextDelta(text))

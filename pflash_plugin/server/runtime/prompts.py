"""A model's prompts as the OpenAI routes send them: chat messages rendered by the model's chat
template, prompts given as text or token ids, logit_bias keys; each checked, a bad one a 400."""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

from llama_cpp import llama_chat_format

from ...chat.content_text import ContentText, Guarded
from ...chat.template import ChatTemplate
from ...chat.tool_calls import REFUSED_CHAT_FORMATS, syntax_for
from ...chat.turns import continued_text, cut_after, render_merging
from ...chat.vision_formats import vision_format
from ...engine.media import MEDIA_MARKER, MediaInput
from ...engine.media_prompt import MediaSpan
from ...llama import Model
from ..wire.protocol import RequestError
from .text_limits import TextLimit

log = logging.getLogger(__name__)


@dataclass
class ChatPrompt:
    tokens: list[int]
    stop: list[str]
    last_user: str | None  # the final user message: PFlash's query
    system: str | None  # the system prompt: always kept by PFlash
    # a prompt with media (issue 46): the text before, between and after its items' markers, each
    # piece tokenized here as text is (the client's text stays text); the items' own tokens come
    # from the engine's projector (preparation/media.py)
    pieces: tuple[list[int], ...] = ()
    media: tuple[MediaInput, ...] = ()
    spans: tuple[MediaSpan, ...] = ()  # where `tokens` hold the media (pseudo-token ids), once tokenized
    text: str = ""  # the template's output, as llama-server's /apply-template answers it


def chat_formatter(model: Model, chat_format: str | None) -> Any:
    """The GGUF's Jinja template unless `chat_format` names one of llama_cpp's formats; raises
    ValueError (at start) for an unknown name. A GGUF without a template gets `fallback_formatter`."""
    template = model.chat_template()
    if chat_format is None and template:
        return ChatTemplate(template, eos_token=model.token_text(model.eos), bos_token=model.token_text(model.bos))
    return named_formatter(chat_format, model) if chat_format else fallback_formatter(model)


# Gemma 3's own chat template, text only: Gemma has no system role, so the system prompt opens the
# first user turn (llama_cpp's `gemma` format drops it, and the tools a described syntax puts there)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{{ (first_user_prefix if loop.first else '') + (message['content'] or '') | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def fallback_formatter(model: Model) -> Any:
    """The chat of a GGUF without a template, said in the log (stock uses llama-2's without a word):
    a Gemma model (the demo, a base Gemma 3 whose tokenizer has the turn tokens, which answered
    nothing in llama-2's format) gets Gemma 3's template, any other llama_cpp's own fallback, llama-2."""
    if model.architecture.startswith("gemma"):
        log.warning("the GGUF (%s) has no chat template: chat messages are rendered with Gemma 3's "
                    "(--chat_format names another format)", model.architecture)
        return ChatTemplate(GEMMA_TEMPLATE, eos_token="<eos>", bos_token="<bos>")
    log.warning("the GGUF (%s) has no chat template: chat messages are rendered in llama_cpp's 'llama-2' format "
                "(--chat_format names another)", model.architecture)
    return named_formatter("llama-2")


def named_formatter(name: str, model: Model | None = None) -> Any:
    """llama_cpp's chat format `name`; raises ValueError (at start) for one this server does not run.
    A vision handler's template (chat/vision_formats.py) writes `model`'s BOS and EOS texts (None:
    the name is only checked)."""
    bos = model.token_text(model.bos) if model is not None and model.add_bos else ""
    vision = vision_format(name, bos, model.token_text(model.eos) if model is not None else "")
    if vision is not None:
        return vision
    if name in REFUSED_CHAT_FORMATS:
        raise ValueError(f"chat_format {name!r} is llama_cpp's own tool-calling handler, which this server "
                         "does not run: leave chat_format unset, and tools work through the model's chat template "
                         "(docs/tools.md)")
    for attr in (f"format_{name.replace('-', '_')}", f"format_{name.replace('-', '')}"):
        formatter = getattr(llama_chat_format, attr, None)
        if formatter is not None:
            return formatter
    raise ValueError(f"unknown chat_format {name!r}")


class Prompts:
    """Tokenizes and checks the prompts of one model."""

    def __init__(self, model: Model, chat_format: str | None, chat_template_kwargs: dict[str, Any],
                 max_ctx: int, tool_syntax: str = "auto") -> None:
        """`tool_syntax`: the --tool_syntax setting (auto: by the template's markers)."""
        self.model = model
        self.limit = TextLimit(model, max_ctx)  # texts too long for max_ctx are refused untokenized
        self._formatter = chat_formatter(model, chat_format)
        self._closing = _closing(self._formatter)  # renders a final assistant turn, to continue it
        self._content = ContentText(model)
        self._template_kwargs = chat_template_kwargs
        # the tool-call syntax the template teaches (a named chat_format renders no tools)
        self.tool_syntax = syntax_for(model.chat_template() if chat_format is None else None, tool_syntax)
        model.render_tokens(self.tool_syntax.markers)  # its markers reach the reader, control tokens too
        self._check_plain_conversation()

    def _check_plain_conversation(self) -> None:
        """Refuse at start (ValueError, one line) a template that cannot render a system prompt and
        a user turn, shaped as render_chat shapes them: every chat request would be a 400 (the
        tool-use variants a GGUF carries beside its default template need tools)."""
        try:
            self.render_chat([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}])
        except RequestError as error:
            reason = " ".join(error.message.split())
            raise ValueError(f"the chat template cannot render a plain conversation (system + user): {reason}; "
                             "--chat_format names another format") from None

    def render_chat(self, messages: list[dict], tools: Any = None, tool_choice: Any = None,
                    template_kwargs: dict[str, Any] | None = None,
                    media: tuple[MediaInput, ...] = ()) -> ChatPrompt:
        """`template_kwargs`: the request's template variables, over the server's chat_template_kwargs.
        The messages' text is text: a control token it spells is not read as one (chat/content_text.py);
        a final assistant message is continued (chat/turns.py). `media`: the items whose markers the
        messages' contents hold, in order (the prompt is then left untokenized: ChatPrompt.text)."""
        kwargs = {**self._template_kwargs, **(template_kwargs or {})}
        guarded = self._content.guard(messages, tools)
        try:
            text, stop, added = render_merging(
                lambda turns: self._render(turns, guarded.tools, tool_choice, kwargs), guarded.messages)
        except RequestError:
            raise
        except Exception as error:  # template errors are the client's messages' fault
            raise RequestError(400, f"the chat template could not render the messages: {error}",
                               param="messages") from None
        self.limit.check_text(text, "messages")
        last_user, system = _last(messages, "user"), _last(messages, "system")
        if media:
            return ChatPrompt([], stop, _last_text(last_user), system, self._media_pieces(text, guarded, media, added),
                              media, text=text)
        tokens = self._content.tokenize(text, guarded, add_special=not added)
        return ChatPrompt(tokens, stop, last_user, system, text=text)

    def _media_pieces(self, text: str, guarded: Guarded, media: tuple[MediaInput, ...],
                      added: bool) -> tuple[list[int], ...]:
        """The text around the media markers, tokenized as a prompt without media is (the BOS
        token first where the template wrote none), so that a control token the client's text
        spells stays text here too (libmtmd would parse it as the token)."""
        pieces = text.split(MEDIA_MARKER)
        if len(pieces) - 1 != len(media):
            raise RequestError(400, f"the rendered prompt holds {len(pieces) - 1} media markers ({MEDIA_MARKER}) "
                               f"for {len(media)} media items: the chat template dropped a media part, or the "
                               f"messages' text spells {MEDIA_MARKER}", param="messages")
        return tuple(self._content.tokenize(piece, guarded, add_special=i == 0 and not added)
                     for i, piece in enumerate(pieces))

    def _render(self, messages: list[dict], tools: Any, tool_choice: Any,
                kwargs: dict[str, Any]) -> tuple[str, list[str], bool]:
        """The prompt's text, its stop strings, and whether it holds the BOS token; a final
        assistant message left open (rendered as a finished turn, cut after its text)."""
        continued = continued_text(messages) if self._closing is not None else None
        formatter = self._formatter if continued is None else self._closing
        result = formatter(messages=messages, tools=tools, tool_choice=tool_choice, **kwargs)
        text = result.prompt
        if continued is not None:
            cut = cut_after(text, continued)
            if cut is None:
                raise RequestError(400, "the chat template does not render the final assistant message's text, "
                                   "so the answer cannot continue it", param="messages")
            text = cut
        stop = result.stop if isinstance(result.stop, list) else [result.stop] if result.stop else []
        return text, stop, bool(result.added_special)

    def tokenize(self, prompt: str, param: str = "prompt") -> list[int]:
        self.limit.check_text(prompt, param)
        return self.model.tokenize(prompt, add_special=True, parse_special=True)

    def tokenize_prompts(self, prompt: str | list, param: str = "prompt") -> list[tuple[list[int], str | None]]:
        """An OpenAI `prompt` or embeddings `input` (text, token ids, or a list of either) as
        (tokens, text) per prompt, the text None where the client sent token ids (`prompt_text`
        writes it only for whoever needs it: 4 prompts of 7K ids took 0.56 s of detokenizing on a
        worker thread, GIL held, on 2 CPU cores); `param` names the field in errors."""
        if isinstance(prompt, str):
            return [(self.tokenize(prompt, param), prompt)]
        if not prompt or isinstance(prompt[0], int):
            return [(self.token_ids(prompt, param), None)]
        return [item for one in prompt for item in self.tokenize_prompts(one, param)]

    def prompt_text(self, tokens: list[int], text: str | None) -> str:
        """A prompt's text as `tokenize_prompts` gave it, written from its tokens where it had none."""
        return text if text is not None else self.model.detokenize(tokens)

    def token_ids(self, tokens: list[int], param: str) -> list[int]:
        """`tokens` copied, or a 400 naming `param` for the first id outside the vocabulary. The
        bounds are read with min and max, in C: a test per id in Python held the GIL 1.4 ms for
        22K ids on 2 CPU cores (0.8 this way), beside the engine thread and the other requests."""
        n_vocab = self.model.n_vocab
        if tokens and (min(tokens) < 0 or max(tokens) >= n_vocab):
            token = next(t for t in tokens if not 0 <= t < n_vocab)
            raise RequestError(400, f"{param}: token id {token} is outside the vocabulary (0..{n_vocab - 1})",
                               param=param)
        return list(tokens)

    def logit_bias(self, raw: dict[str, float] | None, as_tokens: bool) -> dict[int, float]:
        """OpenAI logit_bias keys are token ids; llama_cpp also accepts text (logit_bias_type=tokens)."""
        bias: dict[int, float] = {}
        for key, value in (raw or {}).items():
            if as_tokens:
                for token in self.model.tokenize(key, add_special=False, parse_special=True):
                    bias[token] = value
                continue
            try:
                token = int(key)
            except ValueError:
                raise RequestError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
            if not 0 <= token < self.model.n_vocab:
                raise RequestError(400, f"logit_bias token {token} is outside the vocabulary", param="logit_bias")
            bias[token] = value
        return bias


def _closing(formatter: Any) -> Any:
    """A Jinja template's formatter without the generation prompt (None for llama_cpp's named
    formats, which always open a new turn)."""
    if not isinstance(formatter, llama_chat_format.Jinja2ChatFormatter):
        return None
    closing = copy.copy(formatter)
    closing.add_generation_prompt = False
    return closing


def count_prompts(prompt: str | list) -> int:
    """How many prompts `tokenize_prompts` makes of an OpenAI `prompt`, without tokenizing them."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return sum(count_prompts(one) for one in prompt)


def _last_text(content: str | None) -> str | None:
    """A message's last text between its media markers: the words PFlash finds in the prompt and
    scores with (a media item's positions hold no text)."""
    texts = [piece for piece in (content or "").split(MEDIA_MARKER) if piece.strip()]
    return texts[-1] if texts else None


def _last(messages: list[dict], role: str) -> str | None:
    """The content of the last message of `role` whose content is text."""
    texts = [m["content"] for m in messages if m.get("role") == role and isinstance(m.get("content"), str)]
    return texts[-1] if texts else None

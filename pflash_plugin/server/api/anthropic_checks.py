"""What a Messages body must hold before it is converted to a chat request, checked and worded as
Anthropic's API words it (its fields, its values: tool_choice `any`, never chat's `required`)."""
from __future__ import annotations

from ..runtime.text_limits import TextLimit
from ..wire.anthropic_protocol import CountTokensRequest, MessagesRequest
from ..wire.protocol import RequestError
from ..wire.schema_shape import first_shape_error

TURN_BLOCKS = ("tool_use", "tool_result")


def check_body(body: CountTokensRequest, limit: TextLimit) -> None:
    """The body's size against max_ctx, its tool results' ids, its tool_choice, its tools'
    schemas: each a 400."""
    _check_turns(body, limit)
    _check_tool_results(body)
    _check_tool_choice(body)
    wrong = first_shape_error((f"tools.{i}.input_schema", tool.input_schema) for i, tool in enumerate(body.tools or []))
    if wrong is not None:
        raise RequestError(400, f"{wrong[0]}: {wrong[1]}", param=wrong[0])


def _check_turns(body: CountTokensRequest, limit: TextLimit) -> None:
    """A message, a tool use, a tool result each take a token of the prompt at least: counted
    before anything is converted (200K tool results took 2 s to convert, only to be refused once
    rendered, issue 49)."""
    turns = sum(1 if isinstance(m.content, str) else max(1, sum(b.type in TURN_BLOCKS for b in m.content))
                for m in body.messages)
    limit.check_turns(turns, "messages, tool uses and tool results", "messages")


def _check_tool_results(body: CountTokensRequest) -> None:
    """Each tool_result answers a tool_use of the message before it, as Anthropic requires."""
    asked: set[str] = set()
    for i, message in enumerate(body.messages):
        blocks = [] if isinstance(message.content, str) else message.content
        for j, block in enumerate(blocks):
            if block.type == "tool_result" and block.tool_use_id is not None and block.tool_use_id not in asked:
                raise RequestError(400, f"messages.{i}.content.{j}: tool_result block for tool_use_id "
                                   f"{block.tool_use_id!r}, which no tool_use block of the previous message has: "
                                   "each tool_result must answer a tool_use of the message before it",
                                   param=f"messages.{i}.content.{j}.tool_use_id")
        asked = {b.id for b in blocks if b.type == "tool_use" and b.id is not None}


def _check_tool_choice(body: CountTokensRequest) -> None:
    choice = body.tool_choice
    if choice is None or choice.type not in ("any", "tool"):
        return
    if not body.tools:
        raise RequestError(400, f"tool_choice: type {choice.type!r} needs tools", param="tool_choice")
    if isinstance(body, MessagesRequest) and (body.grammar or body.output_config and body.output_config.format):
        raise RequestError(400, f"tool_choice {choice.type!r} makes the answer a tool call: it cannot be combined "
                           "with output_config.format or grammar", param="tool_choice")

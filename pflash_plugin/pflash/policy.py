"""Which requests PFlash compresses (pure: the server asks, the compressor never decides)."""
from __future__ import annotations

from .compressor import PflashConfig


def skip_reason(
    config: PflashConfig,
    n_tokens: int,
    mode_override: str | None,
    has_tools: bool = False,
    json_format: bool = False,
) -> str | None:
    """None when the prompt should be compressed, else why not.

    Tool calls and JSON output depend on exact prompt details (schemas, examples), so they are
    compressed only when the request itself asks for it.
    """
    mode = mode_override or config.mode
    if mode == "off":
        return "off"
    if (has_tools or json_format) and mode_override is None:
        return "tools or a JSON response format (set pflash.mode to compress anyway)"
    if mode == "auto" and n_tokens <= config.threshold:
        note = f"; {config.threshold_note}" if config.threshold_note else ""
        return f"prompt of {n_tokens} tokens is not over the threshold ({config.threshold}{note})"
    return None

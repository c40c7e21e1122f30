"""What `python -m pflash_plugin.server` says at start: a start-up error as one line (the operator's
mistake, not the program's, so no traceback), one summary line per model once it serves, and a
warning for a setting that can have no effect. The listening socket is bound here, before the
models load, so that a busy port is said at once."""
from __future__ import annotations

import logging
import socket
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from ..config.llama_params import SettingsRefused
from ..config.settings import ModelSettings, ServerSettings
from ..runtime.models import ModelRegistry

log = logging.getLogger("pflash_plugin.server")

# errors whose message alone says what to fix: a bad setting, a missing file, an unknown name
START_ERRORS = (ValidationError, SettingsRefused, FileNotFoundError, ValueError)


def _place(key: str, loc: tuple) -> str:
    """Where a key the settings do not have belongs, when it belongs elsewhere."""
    at_top = len(loc) == 1
    if at_top and key in ModelSettings.model_fields:
        return f"{key} is a model key: put it under one of models: (- model: ... {key}: ...)"
    if not at_top and key in ServerSettings.model_fields:
        return f"{'.'.join(map(str, loc))} is a server key: put it at the top level, beside models:"
    return f"{'.'.join(map(str, loc))}: no such setting (python -m pflash_plugin.server --help lists them)"


def _validation_line(error: ValidationError) -> str:
    problems = []
    for problem in error.errors():
        loc = tuple(problem["loc"])
        if problem["type"] == "extra_forbidden":
            problems.append(_place(str(loc[-1]), loc))
        else:
            problems.append(f"{'.'.join(map(str, loc)) or 'settings'}: {problem['msg']} ({_shown(problem)})")
    return "; ".join(problems)


def _shown(problem: ErrorDetails) -> str:
    """What the setting was given, short, and never a secret: a whole config file, an API key."""
    where = ".".join(map(str, problem["loc"]))
    if not where or "key" in where:
        return "value not shown"
    text = repr(problem["input"])
    return f"got {text if len(text) <= 80 else text[:77] + '...'}"


def start_error(error: BaseException) -> str:
    """The one line that says what stopped the start."""
    if isinstance(error, ValidationError):
        return f"bad settings: {_validation_line(error)}"
    if isinstance(error, SettingsRefused):
        return f"refused: {error}"
    return f"cannot start: {error}"


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (as uvicorn binds it) but not listening yet; ValueError, said in
    one line, for a port out of range or one that cannot be bound (in use, privileged)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not a TCP port (0-65535)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def log_summary(registry: ModelRegistry, settings: ServerSettings, host: str, port: Any) -> None:
    """One line per model: where it serves and how; then a warning for each setting that can have
    no effect."""
    scheme = "https" if settings.ssl_certfile else "http"
    for name, served in registry.models.items():
        log.info("serving %s at %s://%s:%s/v1: %s", name, scheme, host, port, served.summary())
        if served.settings.pflash == "auto" and served.settings.pflash_threshold >= served.max_ctx - 1:
            log.warning("model %s: --pflash auto never compresses here: a prompt has at most max_ctx - 1 = %d "
                        "tokens, and only prompts over pflash_threshold (%d) are compressed; raise --n_ctx "
                        "(or --max_ctx) or lower --pflash_threshold", name, served.max_ctx - 1,
                        served.settings.pflash_threshold)

"""Entry-point plugins: what an installed package can add, discovered by group and by name.

Groups:
- `llama_cpp.server.plugins`: engines and routers for an OpenAI server (the patched stock
  `llama_cpp.server` and `python -m pflash_plugin.server` both read it). An entry point names an
  object with any of `settings` (a namespace with `Settings`, `ServerSettings`, `ModelSettings`,
  `ConfigFileSettings`: subclasses of llama_cpp's), `create_app(server_settings, model_settings)`
  (an engine that serves the models) and `routers` (APIRouters added to the app).
- `pflash_plugin.selectors`: segment selectors, `select(mass, segments, budget, mandatory)`.
- `pflash_plugin.scorers`: token scorers, factories `make(spec, on_gpu=, device=, n_threads=)` of a
  `pflash_plugin.pflash.scorers.Scorer` (the drafter's eval callback and the attention mass).

A plugin that fails to import is logged with its name and skipped: one broken package must not
stop a server.
"""
from __future__ import annotations

import importlib
import logging
import os
from importlib.metadata import entry_points
from typing import Any, Callable

SERVER_GROUP = "llama_cpp.server.plugins"
SELECTOR_GROUP = "pflash_plugin.selectors"
SCORER_GROUP = "pflash_plugin.scorers"
DEFAULT_SELECTOR = "greedy"
DEFAULT_SCORER = "auto"
ENABLED_ENV = "LLAMA_CPP_SERVER_PLUGINS"  # comma-separated server plugins to load (unset: all)

log = logging.getLogger(__name__)


def load_group(group: str) -> dict[str, Any]:
    """Every entry point of `group` that imports, by name; the others are logged and skipped."""
    loaded: dict[str, Any] = {}
    for entry in entry_points(group=group):
        try:
            loaded[entry.name] = entry.load()
        except Exception:
            log.exception("plugin %r (%s, group %s) failed to load; skipped", entry.name, entry.value, group)
    return loaded


def server_plugins() -> dict[str, Any]:
    """The server plugins to use: all installed, or those named in $LLAMA_CPP_SERVER_PLUGINS."""
    wanted = os.environ.get(ENABLED_ENV)
    plugins = load_group(SERVER_GROUP)
    if wanted is not None:
        names = {n.strip() for n in wanted.split(",") if n.strip()}
        plugins = {name: p for name, p in plugins.items() if name in names}
    return plugins


def plugin_routers(plugins: dict[str, Any]) -> list[Any]:
    """The routers the plugins add; a plugin whose `routers` raises is logged and skipped."""
    routers: list[Any] = []
    for name, plugin in plugins.items():
        try:
            routers.extend(getattr(plugin, "routers", None) or [])
        except Exception:
            log.exception("plugin %r: reading its routers failed; skipped", name)
    return routers


# The project's own entries (also registered as entry points), for a source tree that pip never
# installed (no entry points there, e.g. on the GPU machine).
BUILTIN = {
    SELECTOR_GROUP: {"greedy": "pflash_plugin.pflash.selection:select"},
    SCORER_GROUP: {name: f"pflash_plugin.pflash.scorers:{name}_scorer" for name in ("auto", "native", "numpy")},
}


def _named(group: str, name: str, kind: str) -> Callable[..., Any]:
    found = load_group(group)
    if name not in found and name in BUILTIN.get(group, {}):
        module, attr = BUILTIN[group][name].split(":")
        found[name] = getattr(importlib.import_module(module), attr)
    if name not in found:
        installed = ", ".join(sorted(found)) or "none"
        raise ValueError(f"no PFlash {kind} named {name!r} is installed (group {group}); installed: {installed}")
    if not callable(found[name]):
        raise ValueError(f"the PFlash {kind} {name!r} is not callable")
    return found[name]


def selector(name: str = DEFAULT_SELECTOR) -> Callable[..., Any]:
    """The segment selector registered under `name` (group pflash_plugin.selectors)."""
    return _named(SELECTOR_GROUP, name, "selector")


def scorer(name: str = DEFAULT_SCORER) -> Callable[..., Any]:
    """The token scorer registered under `name` (group pflash_plugin.scorers)."""
    return _named(SCORER_GROUP, name, "scorer")

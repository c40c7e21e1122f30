"""Plugins: installed packages that register an entry point in the `pflash_plugin.plugins` group.

Each entry point names a callable that is called once with no arguments at server start, before
the models load (e.g. to register a chat format or a route factory).
"""
from __future__ import annotations

import logging
from importlib.metadata import entry_points

GROUP = "pflash_plugin.plugins"
log = logging.getLogger(__name__)


def load_plugins() -> list[str]:
    loaded = []
    for entry in entry_points(group=GROUP):
        entry.load()()
        loaded.append(entry.name)
        log.info("loaded plugin %s", entry.name)
    return loaded

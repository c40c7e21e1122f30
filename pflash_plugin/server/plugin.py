"""pflash-plugin as a `llama_cpp.server.plugins` entry point (this module is the plugin object):
the engine (our app: the models served concurrently, with PFlash) and the settings classes that
add our keys to the stock flags and config file. The patched stock `python -m llama_cpp.server`
reads these attributes."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from . import settings
from .app import create_app as _create_app

routers: list[Any] = []  # ours are in the app create_app builds


def create_app(server_settings: Any, model_settings: list[Any]) -> FastAPI:
    """Our app, from settings parsed by the stock server (its classes or ours)."""
    server = settings.ServerSettings.model_validate(server_settings.model_dump())
    models = [settings.ModelSettings.model_validate(m.model_dump()) for m in model_settings]
    return _create_app(server, models)

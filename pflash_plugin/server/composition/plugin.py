"""pflash-plugin as a `llama_cpp.server.plugins` entry point (this module is the plugin object):
the engine (our app: the models served concurrently, with PFlash) and the settings classes that
add our keys to the stock flags and config file. The patched stock `python -m llama_cpp.server`
reads these attributes."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from ..config import settings
from .app import create_app as _create_app

routers: list[Any] = []  # ours are in the app create_app builds


def _as(cls: type[BaseModel], value: Any) -> Any:
    """`value` (a stock settings object, or ours, or a config file's) as our class `cls`."""
    fields = {k: v for k, v in value.model_dump(exclude_unset=True).items() if k in cls.model_fields}
    return cls.model_validate(fields)


def create_app(server_settings: Any, model_settings: list[Any]) -> FastAPI:
    """Our app, from settings parsed by the stock server (its classes or ours)."""
    models = [_as(settings.ModelSettings, m) for m in model_settings]
    return _create_app(_as(settings.ServerSettings, server_settings), models)

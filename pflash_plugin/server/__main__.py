"""`python -m pflash_plugin.server`: the flags and config file of `python -m llama_cpp.server`, plus ours."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from typing import cast

import uvicorn
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args

from ..plugins import plugin_routers, server_plugins
from .app import create_app
from .connections import ConnectionLimits, default_max_connections, guarded_protocol
from .llama_params import SettingsRefused
from .settings import ConfigFileSettings, ModelSettings, ServerSettings, Settings


def read_config_file(path: str) -> ConfigFileSettings:
    if not os.path.exists(path):
        raise ValueError(f"Config file {path} not found!")
    with open(path, "rb") as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            return ConfigFileSettings.model_validate_json(json.dumps(yaml.safe_load(f)))
        return ConfigFileSettings.model_validate_json(f.read())


def parse_settings(argv: list[str] | None = None) -> tuple[ServerSettings, list[ModelSettings]]:
    parser = argparse.ArgumentParser(description="pflash-plugin: concurrent llama.cpp server with PFlash")
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file", type=str, help="Path to a config file to load.")
    args = parser.parse_args(argv)
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    if config_file:
        config = read_config_file(config_file)
        return ServerSettings.model_validate(config.model_dump(exclude={"models"})), config.models
    # stock annotates parse_model_from_args(cls) as returning the class; it returns an instance
    server = cast(ServerSettings, parse_model_from_args(ServerSettings, args))
    return server, [cast(ModelSettings, parse_model_from_args(ModelSettings, args))]


SHUTDOWN_MARGIN_S = 5.0


def main(argv: list[str] | None = None) -> None:
    # an abort or a crash inside llama.cpp ends the process: its log then shows every thread's stack;
    # SIGUSR1 writes them without ending it (`kill -USR1 PID` on a server that seems stuck)
    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        server_settings, model_settings = parse_settings(argv)
    except Exception as error:
        print(error, file=sys.stderr)
        sys.exit(1)
    try:
        app = create_app(server_settings, model_settings, extra_routers=plugin_routers(server_plugins()))
    except SettingsRefused as error:  # a stock key set to what the engine cannot honour: say which
        print(f"refused: {error}", file=sys.stderr)
        sys.exit(2)
    uvicorn.run(
        app,
        host=os.getenv("HOST", server_settings.host),
        port=int(os.getenv("PORT", server_settings.port)),
        ssl_keyfile=server_settings.ssl_keyfile,
        ssl_certfile=server_settings.ssl_certfile,
        # a backstop: the engines drain within the grace at the signal (server/shutdown.py)
        timeout_graceful_shutdown=server_settings.shutdown_grace_s + SHUTDOWN_MARGIN_S,  # type: ignore[arg-type]
        http=guarded_protocol(ConnectionLimits(server_settings.header_timeout_s, server_settings.body_timeout_s,
                                               server_settings.max_connections or default_max_connections())),
    )


if __name__ == "__main__":
    main()

"""`python -m pflash_plugin.server`: the flags and config file of `python -m llama_cpp.server`, plus ours."""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
from typing import cast

import uvicorn
from llama_cpp.server.cli import parse_model_from_args

from ..plugins import plugin_routers, server_plugins
from .composition.app import create_app
from .composition.startup import START_ERRORS, listen_socket, log_summary, start_error
from .config.cli import build_parser
from .config.settings import ConfigFileSettings, ModelSettings, ServerSettings
from .operations.connections import ConnectionLimits, default_max_connections, guarded_protocol, log_limit
from .operations.log_handoff import hand_off_logging, write_out


def read_config_file(path: str) -> ConfigFileSettings:
    if not os.path.exists(path):
        raise ValueError(f"Config file {path} not found!")
    with open(path, "rb") as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            try:
                loaded = yaml.safe_load(f)
            except yaml.YAMLError as error:
                raise ValueError(f"{path} is not YAML: {' '.join(str(error).split())}") from None
            return ConfigFileSettings.model_validate_json(json.dumps(loaded, default=str))  # YAML dates
        return ConfigFileSettings.model_validate_json(f.read())


def parse_settings(argv: list[str] | None = None) -> tuple[ServerSettings, list[ModelSettings]]:
    args = build_parser().parse_args(argv)
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    if config_file:
        given = {key: value for key, value in vars(args).items() if value is not None and key != "config_file"}
        model_flags = [f"--{key}" for key in given if key not in ServerSettings.model_fields]
        if model_flags:  # which of the file's models would they set? refused rather than lost
            raise ValueError(f"--config_file {config_file} sets each model under models:, so {' '.join(model_flags)} "
                             "would be ignored: put them there, or leave out --config_file (server flags such as "
                             "--port apply over the file)")
        config = read_config_file(config_file)
        # a server flag wins over the file's key, as the HOST and PORT variables do
        return ServerSettings.model_validate({**config.model_dump(exclude={"models"}), **given}), config.models
    # stock annotates parse_model_from_args(cls) as returning the class; it returns an instance
    server = cast(ServerSettings, parse_model_from_args(ServerSettings, args))
    return server, [cast(ModelSettings, parse_model_from_args(ModelSettings, args))]


# uvicorn's own wait for connections, once the engines have drained (within the grace, at the
# signal): what is left is a response being written, or a body that may never come; the process is
# gone shutdown.HARD_MARGIN_S after the grace whatever it waits for
SHUTDOWN_MARGIN_S = 1.0


def main(argv: list[str] | None = None) -> None:
    # an abort or a crash inside llama.cpp ends the process: its log then shows every thread's stack;
    # SIGUSR1 writes them without ending it (`kill -USR1 PID` on a server that seems stuck)
    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:  # a bad setting, a missing file, an unknown name, a port in use: one line, exit 2
        server_settings, model_settings = parse_settings(argv)
        host, port = os.getenv("HOST", server_settings.host), int(os.getenv("PORT", server_settings.port))
        sock = listen_socket(host, port)  # before the models load: a busy port is said at once
        app = create_app(server_settings, model_settings, extra_routers=plugin_routers(server_plugins()))
    except START_ERRORS as error:
        print(start_error(error), file=sys.stderr)
        sys.exit(2)
    log_summary(app.state.models, server_settings, host, sock.getsockname()[1])
    limits = ConnectionLimits(server_settings.header_timeout_s, server_settings.body_timeout_s,
                              server_settings.max_connections or default_max_connections())
    log_limit(limits.max_connections, derived=server_settings.max_connections is None)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ssl_keyfile=server_settings.ssl_keyfile,
        ssl_certfile=server_settings.ssl_certfile,
        timeout_graceful_shutdown=SHUTDOWN_MARGIN_S,  # type: ignore[arg-type]
        http=guarded_protocol(limits, server_settings.http),
        loop=server_settings.loop,
    )
    hand_off_logging()  # after uvicorn's Config set its loggers up
    try:
        _BoundServer(config).run(sockets=[sock])
    finally:
        write_out()


class _BoundServer(uvicorn.Server):
    """uvicorn's server on the socket bound at start, which says where it runs once it listens
    (uvicorn says so only for a socket it bound itself)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            self._log_started_message(sockets)


if __name__ == "__main__":
    main()

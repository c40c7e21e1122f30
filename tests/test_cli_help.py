"""`--help` in groups, with our defaults and meanings; the flags parse as stock's do."""
from __future__ import annotations

import argparse

from llama_cpp.server.cli import add_args_from_model

from pflash_plugin.server.config.cli import CONCURRENCY, GROUPS, MODEL, PFLASH, SERVER, STOCK, build_parser
from pflash_plugin.server.config.llama_params import REFUSED
from pflash_plugin.server.config.settings import Settings


def sections(text: str) -> dict[str, str]:
    """The help text of each group, by its heading."""
    found, heading = {}, None
    for line in text.splitlines():
        if line.endswith(":") and not line.startswith(" ") and line[:-1] in GROUPS:
            heading = line[:-1]
            found[heading] = ""
        elif heading:
            found[heading] += line + "\n"
    return found


def flag_help(section: str, flag: str) -> str:
    """One flag's help text, its wrapped lines joined."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"--{flag} "))
    rest = [lines[start].strip()]
    for line in lines[start + 1:]:
        if line.strip().startswith("--") or not line.strip():
            break
        rest.append(line.strip())
    return " ".join(rest)


def test_help_comes_in_groups_with_our_defaults_and_meanings():
    text = build_parser().format_help()
    groups = sections(text)
    assert list(groups) == [MODEL, SERVER, CONCURRENCY, PFLASH, STOCK]
    assert "(default: 0.25)" in flag_help(groups[PFLASH], "pflash_keep_ratio")
    assert "(default: 4)" in flag_help(groups[CONCURRENCY], "max_concurrency")
    assert "(default: False)" in flag_help(groups[MODEL], "verbose")  # stock's is True
    assert "--port" in groups[SERVER] and "--port" not in groups[MODEL]
    for key in REFUSED:
        assert flag_help(groups[STOCK], key).split(" ", 2)[2].startswith("REFUSED"), key
    assert "host RAM" in flag_help(groups[STOCK], "cache")
    assert "Accepted, no effect" in flag_help(groups[SERVER], "interrupt_requests")
    assert "docs/tools.md" in flag_help(groups[MODEL], "chat_format")
    assert text.startswith("usage: python -m pflash_plugin.server [--model")


def test_the_grouped_flags_parse_as_stocks_do():
    stock = argparse.ArgumentParser()
    add_args_from_model(stock, Settings)
    argv = ["--n_ctx", "512", "--verbose", "true", "--pflash_layers", "1", "2", "--kv_overrides", "a=int:1",
            "--chat_template_kwargs", '{"x": 1}', "--port", "9000", "--pflash", "auto"]
    ours = vars(build_parser().parse_args(argv))
    assert ours.pop("config_file") is None
    assert ours == vars(stock.parse_args(argv))

"""Entry-point plugins: discovery by name, broken plugins reported and skipped, and the example
third-party plugin (examples/plugin_example) installed with pip and used over HTTP."""
from __future__ import annotations

import logging

import httpx
import pytest

from plugin_env import broken_plugin, install_example, server
from pflash_plugin import plugins
from pflash_plugin.pflash.selection import select


def test_builtin_selector_and_server_plugin_are_registered():
    assert plugins.selector("greedy") is select
    assert "pflash" in plugins.server_plugins()


def test_a_broken_plugin_is_logged_by_name_and_skipped(tmp_path, monkeypatch, caplog):
    monkeypatch.syspath_prepend(str(broken_plugin(tmp_path)))
    with caplog.at_level(logging.ERROR, logger="pflash_plugin.plugins"):
        found = plugins.server_plugins()
        chosen = plugins.selector("greedy")
    assert "pflash" in found and "broken" not in found and chosen is select
    failures = [r.getMessage() for r in caplog.records]
    assert any("'broken'" in m and "llama_cpp.server.plugins" in m for m in failures)
    assert any("'broken'" in m and "pflash_plugin.selectors" in m for m in failures)


def test_unknown_selector_names_the_installed_ones():
    with pytest.raises(ValueError, match="no PFlash selector named 'nope'.*installed: greedy"):
        plugins.selector("nope")


def test_plugins_can_be_chosen_by_environment(monkeypatch):
    monkeypatch.setenv(plugins.ENABLED_ENV, "")
    assert plugins.server_plugins() == {}
    monkeypatch.setenv(plugins.ENABLED_ENV, "pflash, other")
    assert list(plugins.server_plugins()) == ["pflash"]


def test_example_plugin_selector_and_route_over_http(tiny_model, tmp_path):
    example = install_example(tmp_path / "plugins")
    flags = ["--model", str(tiny_model), "--n_ctx", "1024", "--n_threads", "1", "--n_threads_batch", "1",
             "--pflash", "always", "--pflash_selector", "recent", "--pflash_keep_ratio", "0.5"]
    process = server("pflash_plugin.server", flags, tmp_path, [example])
    try:
        with httpx.Client(base_url=process.url, timeout=120) as client:
            assert client.get("/example/selections").json() == {"count": 0, "last": None}
            prompt = " ".join(f"item {i}." for i in range(80))
            usage = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
            report = client.get("/example/selections").json()
    finally:
        process.stop()
    pflash = usage["timings"]["pflash"]
    assert pflash["status"] == "compressed" and pflash["kept_tokens"] <= usage["prompt_tokens"] // 2
    assert report["count"] == 1
    head, tail = report["last"][0], report["last"][-1]
    assert head[0] == 0 and tail[1] == usage["prompt_tokens"]  # mandatory head, then the most recent tokens
    assert sum(end - start for start, end in report["last"]) == pflash["kept_tokens"]

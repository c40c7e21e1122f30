"""--gil_switch_ms: the process's thread switch interval, which bounds how long an engine thread back
from a decode (run without the GIL) waits for it while the event loop runs Python."""
from __future__ import annotations

import sys

import pytest
from starlette.testclient import TestClient

from pflash_plugin.server.composition.app import create_app
from pflash_plugin.server.config.settings import ModelSettings, ServerSettings


@pytest.fixture
def switch_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def model(tiny_model) -> ModelSettings:
    return ModelSettings(model=str(tiny_model), n_ctx=512, max_concurrency=1, n_threads=1, n_threads_batch=1)


def test_the_flag_sets_the_switch_interval(tiny_model, switch_interval):
    sys.setswitchinterval(0.005)
    with TestClient(create_app(ServerSettings(gil_switch_ms=0.5), [model(tiny_model)])):  # closed after
        pass
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_unset_leaves_python_s_interval(tiny_model, switch_interval):
    sys.setswitchinterval(0.004)
    with TestClient(create_app(ServerSettings(), [model(tiny_model)])):
        pass
    assert sys.getswitchinterval() == pytest.approx(0.004)


def test_a_zero_or_negative_interval_is_refused():
    with pytest.raises(ValueError, match="gil_switch_ms"):
        ServerSettings(gil_switch_ms=0)

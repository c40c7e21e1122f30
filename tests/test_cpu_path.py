"""The AMX fallback: a probe child that dies by a signal makes every model load without extra
buffer types, decided once per process, and /status says which path is used. The real trap needs
an AMX CPU with a native AMX build; here the probe's failure is simulated by injected commands."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import llama_cpp.llama_cpp as C
import pytest

from conftest import live_server
from pflash_plugin.engine.loader import EngineConfig, load_model
from pflash_plugin.llama import Model, cpu_path
from pflash_plugin.llama.cpu_path import CpuPath, decide, run_probe

SIGILL_CHILD = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
CRASHED = "no-extra-bufts (AMX probe crashed: SIGILL)"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No verdict yet, on a machine that looks like it has AMX in CPU and build."""
    monkeypatch.setattr(cpu_path, "_verdict", None)
    monkeypatch.delenv(cpu_path.ENV, raising=False)
    monkeypatch.setattr(cpu_path, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(cpu_path, "build_has_amx", lambda: True)
    return monkeypatch


@pytest.fixture
def load_params(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """use_extra_bufts of every model load, as llama.cpp receives it."""
    seen: list[bool] = []
    real = C.llama_model_load_from_file

    def spy(path: bytes, params: C.llama_model_params) -> object:
        seen.append(bool(params.use_extra_bufts))
        return real(path, params)

    monkeypatch.setattr(C, "llama_model_load_from_file", spy)
    return seen


def test_a_probe_killed_by_a_signal_means_no_extra_bufts(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=cpu_path.__name__):
        assert run_probe(SIGILL_CHILD) == CpuPath(False, CRASHED)
    assert "without extra buffer types" in caplog.text and "SIGILL" in caplog.text


def test_a_failed_or_hung_probe_also_falls_back() -> None:
    failed = run_probe([sys.executable, "-c", "import sys; sys.exit('no gguf')"])
    assert failed == CpuPath(False, "no-extra-bufts (AMX probe failed: exit 1)")
    hung = run_probe([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=0.5)
    assert not hung.use_extra_bufts and "hung" in hung.label


@pytest.mark.skipif(cpu_path.cpu_has_amx() and cpu_path.build_has_amx(), reason="AMX here: the probe may trap")
def test_the_real_probe_child_loads_and_decodes() -> None:
    # without AMX kernels the child runs the repacked-weight path (Q4_0) and exits cleanly
    assert run_probe(cpu_path.probe_command()) == CpuPath(True, "amx")


def test_probe_runs_once_per_process(fresh: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def command() -> list[str]:
        commands.append(SIGILL_CHILD)
        return SIGILL_CHILD

    fresh.setattr(cpu_path, "probe_command", command)
    assert cpu_path.verdict() == cpu_path.verdict() == CpuPath(False, CRASHED)
    assert len(commands) == 1


@pytest.mark.parametrize(
    ("setting", "amx", "expected"),
    [
        ("auto", False, CpuPath(True, "default")),
        ("auto", True, CpuPath(False, CRASHED)),
        ("off", True, CpuPath(False, "no-extra-bufts (PFLASH_EXTRA_BUFTS=off)")),
        ("on", True, CpuPath(True, "amx (PFLASH_EXTRA_BUFTS=on, not probed)")),
        ("on", False, CpuPath(True, "default (PFLASH_EXTRA_BUFTS=on, not probed)")),
    ],
)
def test_decide_probes_only_on_auto_with_amx(setting: str, amx: bool, expected: CpuPath) -> None:
    probed: list[bool] = []

    def probe() -> CpuPath:
        probed.append(True)
        return run_probe(SIGILL_CHILD)

    assert decide(setting, amx, probe) == expected
    assert probed == ([True] if setting == "auto" and amx else [])
    with pytest.raises(ValueError, match="auto, on or off"):
        decide("maybe", amx, probe)


def test_env_override_skips_the_probe(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv(cpu_path.ENV, "off")
    fresh.setattr(cpu_path, "probe_command", lambda: pytest.fail("probed despite the override"))
    assert cpu_path.verdict() == CpuPath(False, "no-extra-bufts (PFLASH_EXTRA_BUFTS=off)")


def test_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert cpu_path.cpu_has_amx(info)
    info.write_text("processor : 0\nflags : fpu avx512f amx_tile_x\n")
    assert not cpu_path.cpu_has_amx(info)
    assert not cpu_path.cpu_has_amx(tmp_path / "missing")


def test_the_verdict_reaches_the_model_params(
    fresh: pytest.MonkeyPatch, load_params: list[bool], tiny_model: Path
) -> None:
    fresh.setattr(cpu_path, "probe_command", lambda: SIGILL_CHILD)
    model = load_model(tiny_model, EngineConfig(max_ctx=256))  # the engine's load; the drafter's is a Model too
    assert load_params == [False] and model.cpu_path == CRASHED
    model.close()
    assert Model(tiny_model, vocab_only=True).cpu_path == "set by the caller"  # no probe for a vocabulary
    assert load_params == [False, True]


def test_status_reports_the_cpu_path(fresh: pytest.MonkeyPatch, load_params: list[bool], tiny_model: Path) -> None:
    fresh.setattr(cpu_path, "probe_command", lambda: SIGILL_CHILD)
    with live_server(
        [{"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 256, "n_threads": 1, "n_threads_batch": 1}]
    ) as server:
        assert server.status("tiny")["cpu_path"] == CRASHED
    assert load_params and not any(load_params)

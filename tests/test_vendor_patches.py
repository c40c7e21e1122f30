"""vendor_patches: the plugin-hook patch against llama-cpp-python 0.3.36's llama_cpp/server/.

Every test works on a private overlay of the installed package (plugin_env.overlay_llama_cpp),
reverted in `finally`, so the shared install is never patched, even when a test fails."""
from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from plugin_env import REPO, broken_plugin, free_port, install_example, overlay_llama_cpp, patched_llama_cpp, server
from pflash_plugin import vendor_patches
from pflash_plugin.vendor_patches import PatchError, State, Target

FILES = ("llama_cpp/server/app.py", "llama_cpp/server/__main__.py", "llama_cpp/server/plugins.py")


@pytest.fixture
def overlay(tmp_path) -> Path:
    return overlay_llama_cpp(tmp_path / "site")


def cli(overlay: Path, action: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{overlay}:{REPO}", "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "pflash_plugin.vendor_patches", action]
    return subprocess.run(command, capture_output=True, text=True, env=env)


def snapshot(root: Path) -> dict[str, str | None]:
    return {f: (root / f).read_text() if (root / f).exists() else None for f in FILES}


def test_apply_is_idempotent_check_reports_and_revert_restores_the_stock_files(overlay):
    stock = snapshot(overlay)
    assert stock["llama_cpp/server/plugins.py"] is None
    try:
        assert cli(overlay, "check").returncode == 1  # stock: not applied
        applied = cli(overlay, "apply")
        assert applied.returncode == 0 and str(overlay) in applied.stdout  # the overlay, not the shared install
        patched = snapshot(overlay)
        assert "server_plugins.create_plugin_app" in patched["llama_cpp/server/app.py"]
        assert patched["llama_cpp/server/plugins.py"]
        again = cli(overlay, "apply")
        assert again.returncode == 0 and "already patched" in again.stdout and snapshot(overlay) == patched
        check = cli(overlay, "check")
        assert check.returncode == 0 and check.stdout.count("patched") == 3
    finally:
        reverted = cli(overlay, "revert")
    assert reverted.returncode == 0
    assert snapshot(overlay) == stock  # byte for byte, the new module removed
    assert cli(overlay, "revert").stdout.startswith("not patched")


@pytest.mark.parametrize("edit", ["llama_cpp/server/app.py", "llama_cpp/server/plugins.py"])
def test_check_fails_on_a_modified_file_and_apply_refuses_to_touch_it(overlay, edit):
    target = Target(overlay, vendor_patches.SUPPORTED_VERSION)
    vendor_patches.apply_patch(target)
    try:
        with (overlay / edit).open("a") as f:
            f.write("# edited by hand\n")  # outside every hunk: only a whole-file check sees it
        before = snapshot(overlay)
        check = cli(overlay, "check")
        assert check.returncode == 2 and f"modified  {overlay / edit}" in check.stdout
        for action in ("apply", "revert"):
            refused = cli(overlay, action)
            assert refused.returncode == 2 and edit in refused.stderr
        assert snapshot(overlay) == before  # nothing written
    finally:
        text = (overlay / edit).read_text()
        (overlay / edit).write_text(text.replace("# edited by hand\n", ""))
        vendor_patches.revert_patch(target)
    assert all(state is State.ORIGINAL for state in vendor_patches.states(target).values())


def test_refuses_another_version_naming_the_supported_one(overlay):
    with pytest.raises(PatchError, match=r"0\.3\.36 only; the installed version is 0\.3\.35"):
        vendor_patches.apply_patch(Target(overlay, "0.3.35"))
    assert snapshot(overlay)["llama_cpp/server/plugins.py"] is None


def test_a_failed_write_leaves_no_file_patched(overlay, monkeypatch):
    stock = snapshot(overlay)
    real_put, calls = vendor_patches._put, []

    def failing_put(path, text):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_put(path, text)

    monkeypatch.setattr(vendor_patches, "_put", failing_put)
    with pytest.raises(OSError):
        vendor_patches.apply_patch(Target(overlay, vendor_patches.SUPPORTED_VERSION))
    assert snapshot(overlay) == stock


# ---- the patched stock server -----------------------------------------------------------------
@pytest.fixture(scope="module")
def patched(tmp_path_factory, tiny_model):
    return patched_llama_cpp(tmp_path_factory.mktemp("patched") / "site")


def openapi_of(path: list[Path], model: Path, env: dict[str, str]) -> dict:
    code = ("import json; from llama_cpp.server.app import create_app; from llama_cpp.server.settings import Settings; "
            f"print(json.dumps(create_app(Settings(model={str(model)!r}, verbose=False)).openapi()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": ":".join(map(str, path)), "PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_patched_stock_without_plugins_is_stock(patched, tiny_model, tmp_path):
    no_plugins = {"LLAMA_CPP_SERVER_PLUGINS": ""}
    assert openapi_of([patched], tiny_model, no_plugins) == openapi_of([], tiny_model, {})
    stock = server("llama_cpp.server", ["--model", str(tiny_model), "--n_ctx", "256"], tmp_path, [patched], no_plugins)
    try:
        with httpx.Client(base_url=stock.url, timeout=60) as client:
            reply = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            assert client.get("/status").status_code == 404  # the stock app, not ours
    finally:
        stock.stop()


def stream(url: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    text, usage = "", {}
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += "".join(c["text"] for c in chunk["choices"])
    return text, usage


def test_patched_stock_with_pflash_serves_streams_concurrently_with_our_flags(patched, tiny_model, tmp_path):
    flags = ["--model", str(tiny_model), "--model_alias", "tiny", "--n_ctx", "1024", "--max_concurrency", "4",
             "--n_threads", "1", "--n_threads_batch", "1", "--pflash", "auto", "--pflash_threshold", "200"]
    process = server("llama_cpp.server", flags, tmp_path, [patched, broken_plugin(tmp_path / "broken")])
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], httpx.get(process.url + "/status").json()["models"]["tiny"]["running"])
            time.sleep(0.01)

    try:
        watcher = threading.Thread(target=watch)
        watcher.start()
        with cf.ThreadPoolExecutor(6) as pool:
            # long enough that the streams overlap however late a loaded machine starts some of them
            results = list(pool.map(lambda i: stream(process.url, f"stream {i} of six", 400), range(6)))
        long_prompt = " ".join(f"fact {i}." for i in range(80))  # ~680 tokens
        compressed = httpx.post(process.url + "/v1/completions", timeout=120,
                                json={"prompt": long_prompt, "max_tokens": 2}).json()
        done.set()
        watcher.join()
    finally:
        done.set()
        process.stop()
    assert all(text and usage["completion_tokens"] == 400 for text, usage in results)
    assert peak[0] >= 2  # several streams decoded at once
    assert compressed["usage"]["timings"]["pflash"]["status"] == "compressed", compressed
    log = process.log_path.read_text()
    assert "'broken'" in log and "failed to load; skipped" in log  # reported by name, and the server still served


def test_patched_stock_reads_our_keys_from_its_config_file(patched, tiny_model, tmp_path):
    config = tmp_path / "config.yaml"
    port = free_port()  # with a config file, stock takes host and port from it, not from flags
    config.write_text(f"host: 127.0.0.1\nport: {port}\nmodels:\n  - model: {tiny_model}\n    model_alias: configured\n"
                      "    n_ctx: 256\n    max_concurrency: 3\n    n_threads: 1\n    n_threads_batch: 1\n")
    process = server("llama_cpp.server", ["--config_file", str(config)], tmp_path, [patched], port=port)
    try:
        status = httpx.get(process.url + "/status").json()["models"]
        models = httpx.get(process.url + "/v1/models").json()["data"]
    finally:
        process.stop()
    assert [m["id"] for m in models] == ["configured"] and len(status["configured"]["slots"]) == 3


def test_example_plugin_routes_reach_the_patched_stock_server(patched, tiny_model, tmp_path):
    example = install_example(tmp_path / "plugins")
    flags = ["--model", str(tiny_model), "--n_ctx", "1024", "--n_threads", "1", "--n_threads_batch", "1",
             "--pflash", "always", "--pflash_selector", "recent", "--pflash_keep_ratio", "0.5"]
    process = server("llama_cpp.server", flags, tmp_path, [patched, example])
    try:
        prompt = " ".join(f"line {i}." for i in range(80))
        usage = httpx.post(process.url + "/v1/completions", timeout=120,
                           json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
        report = httpx.get(process.url + "/example/selections").json()
    finally:
        process.stop()
    n = usage["prompt_tokens"]
    assert usage["timings"]["pflash"]["status"] == "compressed" and report["count"] == 1
    assert report["last"][-1][1] == n  # the recency selector kept the prompt's tail

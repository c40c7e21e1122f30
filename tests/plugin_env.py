"""Environments for plugin and vendor-patch tests, built in temporary directories so that the
shared installed llama-cpp-python is never touched: an overlay of the installed `llama_cpp`
(its `server/` copied, everything else linked), the example plugin pip-installed into a target
directory, a broken plugin, and server processes that see them through PYTHONPATH."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugin_example"
sys.path.insert(0, str(REPO / "bench"))
from harness import ServerProcess, free_port  # noqa: E402  (bench/ is not a package)


def overlay_llama_cpp(dest: Path) -> Path:
    """A directory to put first on PYTHONPATH: `llama_cpp` whose `server/` is a private copy."""
    real = Path(importlib.util.find_spec("llama_cpp").origin).parent
    package = dest / "llama_cpp"
    package.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name == "server":
            shutil.copytree(entry, package / "server", ignore=shutil.ignore_patterns("__pycache__"))
        elif entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    return dest


def patched_llama_cpp(dest: Path) -> Path:
    """An overlay (see overlay_llama_cpp) whose `llama_cpp/server/` carries the plugin-hook patch."""
    from pflash_plugin import vendor_patches

    overlay = overlay_llama_cpp(dest)
    vendor_patches.apply_patch(vendor_patches.Target(overlay, vendor_patches.SUPPORTED_VERSION))
    return overlay


def install_example(dest: Path) -> Path:
    """pip-install examples/plugin_example into `dest` (no dependencies; no network where the
    environment can build without isolation, else pip's own configured indexes)."""
    source = shutil.copytree(EXAMPLE, dest.with_name(dest.name + "-src"))  # pip builds in the tree it is given
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(dest), str(source)]
    for extra in (["--no-build-isolation"], []):
        done = subprocess.run(base[:5] + extra + base[5:], capture_output=True, text=True)
        if done.returncode == 0:
            return dest
    raise RuntimeError(f"pip could not install the example plugin:\n{done.stderr}")


def broken_plugin(dest: Path) -> Path:
    """An installed distribution whose entry points name a module that does not exist."""
    info = dest / "broken_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[llama_cpp.server.plugins]\nbroken = no_such_module_for_pflash_tests:plugin\n\n"
        "[pflash_plugin.selectors]\nbroken = no_such_module_for_pflash_tests:select\n"
    )
    return dest


def server(module: str, args: list[str], log_dir: Path, path: list[Path], env: dict[str, str] | None = None,
           port: int | None = None) -> ServerProcess:
    """A started server process with `path` first on its PYTHONPATH and `env` set."""
    process = ServerProcess(label=module.replace(".", "_"), args=args, module=module, log_dir=log_dir,
                            ready_paths=("/v1/models",), port=port or free_port())
    saved = {k: os.environ.get(k) for k in ["PYTHONPATH", *(env or {})]}
    os.environ.update({"PYTHONPATH": os.pathsep.join(map(str, path)), **(env or {})})
    try:
        process.launch()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        process.wait_ready(120)
    except RuntimeError:
        process.stop()
        raise RuntimeError(process.log_path.read_text()[-3000:]) from None
    return process

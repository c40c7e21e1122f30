"""Puts libmtmd into the device's llama-cpp-python: a queue's first line (after bench/gpu/servers.sh's
setup). llama-cpp-python's LLAVA_BUILD beside the LLAMA_BUILD_TOOLS of the one-build path fails to
configure, but the tools' build makes libmtmd in the same tree: copied into llama_cpp/lib, the wheel's
`llama_cpp.mtmd_cpp` loads it (the upstream example server, images: bench/vision.py).

    bash bench/gpu/servers.sh bench/gpu/mtmd_from_build.py [--build /tmp/lcp-build]
"""
from __future__ import annotations

import argparse
import importlib
import shutil
from pathlib import Path

import llama_cpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=Path("/tmp/lcp-build"))
    args, _ = parser.parse_known_args()  # servers.sh passes --target, --drafter, --llama-server
    lib = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(p for p in args.build.rglob("libmtmd.so*") if p.is_file() or p.is_symlink())
    if not found:
        raise SystemExit(f"no libmtmd.so under {args.build}")
    for path in found:
        shutil.copy2(path, lib / path.name, follow_symlinks=True)
    importlib.import_module("llama_cpp.mtmd_cpp")  # fails here, not in a bench, where it does not load
    print("libmtmd:", ", ".join(p.name for p in found), "->", lib)


if __name__ == "__main__":
    main()

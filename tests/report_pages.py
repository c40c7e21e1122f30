"""What the report tests share: a bench script loaded as a module, and a page's markdown tables."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def bench_module(relative: str) -> ModuleType:
    """bench/<relative> (a script, not a package member) imported under its file's stem."""
    path = REPO / "bench" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tables(page: str) -> list[list[dict[str, str]]]:
    """Every markdown table of the page, each row as {column: cell}."""
    found, block = [], []
    for line in [*page.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip("|").split("|")])
        elif block:
            found.append([dict(zip(block[0], row)) for row in block[2:]])
            block = []
    return found

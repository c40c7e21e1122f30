"""`python -m pflash_plugin.vendor_patches apply|check|revert` on the installed llama-cpp-python.

Exit status: 0 done (check: the patch is applied and intact); 1 check: not applied (the stock
files, which the patch applies to cleanly); 2 refused: another version, or files modified since.
"""
from __future__ import annotations

import argparse
import sys

from . import PatchError, State, Target, apply_patch, revert_patch, states


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pflash_plugin.vendor_patches",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["apply", "check", "revert"])
    action = parser.parse_args(argv).action
    try:
        target = Target.installed()
        if action == "apply":
            print(f"patched llama-cpp-python in {target.root}" if apply_patch(target) else "already patched")
            return 0
        if action == "revert":
            reverted = revert_patch(target)
            print(f"restored stock llama-cpp-python in {target.root}" if reverted else "not patched: nothing to revert")
            return 0
        found = states(target)
        for path, state in found.items():
            print(f"{state.value:9} {target.root / path}")
        if State.MODIFIED in found.values():
            print("modified since install: reinstall llama-cpp-python, then apply", file=sys.stderr)
            return 2
        return 0 if set(found.values()) == {State.PATCHED} else 1
    except PatchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Builds ggml_ext/ (the native PFlash scorer) as pflash_plugin/_pflash_ext*.so during `pip install`.

A failed native build leaves the numpy scorer in charge and says so, unless PFLASH_EXT_REQUIRED=1.
"""
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent / "ggml_ext"))
import pflash_build as ggml_ext_build  # noqa: E402


class BuildGgmlExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        output = Path(self.get_ext_fullpath(ext.name))
        try:
            kind = ggml_ext_build.build(output)
            print(f"pflash-plugin: native scorer built for {kind}: {output}")
        except Exception as error:  # an optional speed-up: never block the install
            if os.environ.get("PFLASH_EXT_REQUIRED") == "1":
                raise
            print(f"WARNING: pflash-plugin's native scorer was not built ({error}); PFlash scores with numpy",
                  file=sys.stderr)


setup(ext_modules=[Extension("pflash_plugin._pflash_ext", sources=[])], cmdclass={"build_ext": BuildGgmlExt})

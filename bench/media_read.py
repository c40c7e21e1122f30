"""The API side's cost of an inline image (issue 46): a data URL read, checked (size, magic, pixels
from the header) and decoded by server/runtime/media_reader.py, and one over --media_max_bytes
refused before it is decoded; plain base64 and MIME base64 (line breaks). CPU only, no model.

    python bench/media_read.py [--reps 5]
"""
from __future__ import annotations

import argparse
import base64
import os
import time
from typing import Callable

from pflash_plugin.server.operations.media_fetch import FetchLimits
from pflash_plugin.server.runtime.media_reader import MediaLimits, MediaReader
from pflash_plugin.server.wire.media_parts import MediaSource
from pflash_plugin.server.wire.protocol import RequestError
from pflash_plugin.testing.media_files import png

LIMIT = 20 * 2**20
ENCODINGS: dict[str, Callable[[bytes], bytes]] = {"plain": base64.b64encode, "MIME lines": base64.encodebytes}


def ms_per_read(reader: MediaReader, url: str, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        try:
            reader.read([MediaSource("image", "x", url=url)])
        except RequestError:
            pass
    return (time.perf_counter() - start) / reps * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    reps = parser.parse_args().reps
    reader = MediaReader(MediaLimits(16, 50_000_000, FetchLimits(frozenset(), LIMIT, 10.0)), frozenset({"image"}))
    image = png(1024, 1024)  # random pixels: about 3 MB
    cases = {"3 MB PNG": image, "19 MB PNG": image + os.urandom(19 * 2**20 - len(image)),
             "21 MB (over the 20 MiB limit)": os.urandom(21 * 2**20)}
    print("| item | base64 | ms per item |\n|---|---|---|")
    for name, data in cases.items():
        for encoding, encode in ENCODINGS.items():
            url = "data:image/png;base64," + encode(data).decode()
            print(f"| {name} | {encoding} | {ms_per_read(reader, url, reps):.2f} |")


if __name__ == "__main__":
    main()

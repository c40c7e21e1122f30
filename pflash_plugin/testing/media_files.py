"""Small media files written in code for tests (issue 46): a real PNG and a PPM (what libmtmd decodes), a
WAV clip, and the headers of the other formats the server sniffs, so tests need no image library."""
from __future__ import annotations

import base64
import random
import struct
import zlib

import numpy as np


def png(width: int = 16, height: int = 16, seed: int = 0) -> bytes:
    """An 8-bit RGB PNG of random pixels."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + bytes(rng.randrange(256) for _ in range(width * 3)) for _ in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def ppm(seed: int, width: int = 40, height: int = 30) -> bytes:
    """A binary PPM of random pixels (libmtmd's stb_image reads it; no imaging library needed)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return f"P6\n{width} {height}\n255\n".encode() + pixels.tobytes()


def wav(samples: int = 1600, rate: int = 16000) -> bytes:
    """A mono 16-bit PCM WAV of silence."""
    data = b"\x00\x00" * samples
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def jpeg_header(width: int, height: int) -> bytes:
    """A JPEG's start up to its frame header (an APP0 segment, then SOF0): what a size reader reads."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof0


def gif_header(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00"


def bmp_header(width: int, height: int) -> bytes:
    return b"BM" + b"\x00" * 16 + struct.pack("<ii", width, height) + b"\x00" * 28


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"

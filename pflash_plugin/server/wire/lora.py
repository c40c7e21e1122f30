"""llama-server's LoRA scale lists (server-common.cpp, parse_lora_request): `[{"id": 0, "scale": 0.5}]`,
on POST /lora-adapters and a request's `lora` field, read as llama-server reads them: a listed
adapter gets its scale, every other one 0."""
from __future__ import annotations

import math
from typing import Any, List, Sequence

from pydantic import TypeAdapter, ValidationError

from .protocol import LoraScale, RequestError

_SCALES = TypeAdapter(List[LoraScale])


def scale_list(body: Any) -> list[LoraScale]:
    """POST /lora-adapters' body: an array of {id, scale} (llama-server refuses anything else too)."""
    if not isinstance(body, list):
        raise RequestError(400, 'the body must be an array of {"id", "scale"} objects')
    try:
        return _SCALES.validate_python(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RequestError(400, f"{where}: {first['msg']}", param=where) from None


def asked_scales(entries: Sequence[LoraScale], loaded: int, param: str) -> list[float]:
    """Each loaded adapter's scale as `entries` set them (the unlisted: 0); an id not loaded or a
    scale that is not a finite number is a 400 naming the entry."""
    scales = [0.0] * loaded
    for i, entry in enumerate(entries):
        if not 0 <= entry.id < loaded:
            raise RequestError(400, f"{param}.{i}.id: no LoRA adapter {entry.id} ({loaded} loaded)",
                               param=f"{param}.{i}.id")
        if not math.isfinite(entry.scale):
            raise RequestError(400, f"{param}.{i}.scale must be a finite number", param=f"{param}.{i}.scale")
        scales[entry.id] = entry.scale
    return scales

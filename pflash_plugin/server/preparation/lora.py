"""The served model's LoRA adapters as llama-server shows and takes them (GET/POST /lora-adapters,
a request's `lora`). Their scales are the server's: llama.cpp sets adapters on a whole context,
whose batches carry every running request together, so one request cannot have scales of its own
(llama-server batches only slots of equal scales), and changing them while requests run would
change those answers mid-way."""
from __future__ import annotations

from typing import Any, Sequence

from ..runtime.models import ServedModel
from ..wire.lora import asked_scales
from ..wire.protocol import LoraScale, RequestError


def adapters(served: ServedModel) -> list[dict[str, Any]]:
    """llama-server's GET /lora-adapters entries (no task name or prompt prefix: GGUF metadata we do not read)."""
    return [{"id": i, "path": path, "scale": scale, "task_name": "", "prompt_prefix": ""}
            for i, (path, scale) in enumerate(served.model.params.loras)]


def refuse_other_scales(served: ServedModel, entries: Sequence[LoraScale] | None, param: str) -> None:
    """A 400 for scales other than the server's (None: the server's)."""
    if entries is None:
        return
    loaded = [scale for _, scale in served.model.params.loras]
    if asked_scales(entries, len(loaded), param) != loaded:
        raise RequestError(400, f"{param}: LoRA scales other than the server's ({loaded}) are not served: llama.cpp "
                           "applies adapters to the whole context that the running requests share; they are set "
                           "at start (--lora_path, scale 1.0)", param=param)


def refuse_request_scales(served: ServedModel, entries: Sequence[LoraScale] | None) -> None:
    """A request's `lora`: none or [] takes the server's scales (llama-server's rule), others a 400."""
    refuse_other_scales(served, entries or None, "lora")

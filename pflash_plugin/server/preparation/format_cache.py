"""The constraint of each response_format a model has prepared, by its schema's text: a client that
sends the same schema with every request (a pydantic parse, an extraction loop, a benchmark) pays
the schema's checks, bounds, GBNF conversion and llguidance compile once (each request's matcher
is still its own, built beside: engine/constraints.py `prebuild`), and such a request with a
short prompt is then prepared on the event loop as a plain one is (inline.py), not behind a worker
thread and the GIL beside its peers. 64 clients starting at once with one schema on 2 CPU cores had
their first token ~60 ms later than plain ones through that hop alone (issue 49).
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

from ..runtime.models import ServedModel
from ..wire.protocol import RequestError, ResponseFormat
from .constraint import Constrained

MAX_NODES = 512  # a schema with more objects, lists and values than this is never keyed (nor inlined)
MAX_CHARS = 65536  # nor one whose keys and strings hold more characters: its key is JSON text, made on the loop


def _small(schema: Any) -> bool:
    """Whether the schema holds at most MAX_NODES values and MAX_CHARS characters of keys and
    strings (walked no further than either)."""
    stack, nodes, chars = [schema], 0, 0
    while stack:
        nodes += 1
        value = stack.pop()
        if isinstance(value, dict):
            chars += sum(len(key) for key in value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            chars += len(value)
        if nodes > MAX_NODES or chars > MAX_CHARS:
            return False
    return True


def format_key(response_format: ResponseFormat | None) -> str | None:
    """The cache's key of a JSON response_format: its schema as JSON text, keys in the client's order
    (the order of `properties` is the answer's order of fields; json_object and a json_schema without
    a schema both mean any JSON, and prepare alike); None for text, a schema over MAX_NODES or
    MAX_CHARS, or a format the preparation refuses (it says why there)."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        schema = response_format.schema_for_grammar()
    except RequestError:
        return None
    if not _small(schema):
        return None
    return json.dumps(schema, separators=(",", ":"))


class FormatCache:
    """The last `limit` formats' constraints of one served model (its model, its constraint engine)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ready: OrderedDict[str, Constrained] = OrderedDict()

    def __contains__(self, key: str | None) -> bool:
        with self._lock:
            return key is not None and key in self._ready

    def get(self, key: str | None, prepare: Callable[[], Constrained]) -> tuple[Constrained, bool]:
        """The constraint kept for `key` (and True), else `prepare()`'s, kept where keyed (an
        error is not), and False."""
        if key is None:
            return prepare(), False
        with self._lock:
            found = self._ready.get(key)
            if found is not None:
                self._ready.move_to_end(key)
                return found, True
        made = prepare()
        with self._lock:
            self._ready[key] = made
            while len(self._ready) > self.limit:
                self._ready.popitem(last=False)
        return made, False


_CACHES: weakref.WeakKeyDictionary[ServedModel, FormatCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def formats(served: ServedModel) -> FormatCache:
    """The served model's cache (made on first use; it goes with the model)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(served)
        if cache is None:
            cache = _CACHES[served] = FormatCache()
        return cache

"""Start-up calibration of `--pflash auto`: one prompt prefilled in full and with PFlash, through the
engine, so that auto mode does not compress where compression does not pay (see pflash/payoff.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from ...llama import Model
from ...pflash.compressor import PflashConfig
from ...pflash.payoff import Calibration, effective_threshold
from .inprocess import Run, Target, random_prompt


class Calibrated(Target, Protocol):
    """What calibration needs of a served model (models.ServedModel has it)."""

    @property
    def name(self) -> str: ...

    @property
    def max_ctx(self) -> int: ...

    @property
    def pflash(self) -> PflashConfig: ...

    @property
    def model(self) -> Model: ...


@dataclass(frozen=True)
class Outcome:
    """What the calibration measured, and the PFlash config auto mode should serve with."""

    calibration: Calibration
    config: PflashConfig

log = logging.getLogger(__name__)
CALIBRATION_TOKENS = 32768  # long enough for attention to weigh, short enough to take seconds on a GPU
WARMUP_TOKENS = 512
ANSWER_ROOM = 64


def calibration_length(threshold: int, max_ctx: int) -> int | None:
    """The prompt length to measure, or None when no prompt over the threshold fits."""
    n = min(max_ctx - ANSWER_ROOM, CALIBRATION_TOKENS)
    return n if n > threshold else None


def measure(served: Calibrated, n_tokens: int) -> Calibration:
    """Warm both paths up, then time a full prefill and a PFlash prefill of different prompts (the
    prefix cache must serve neither)."""
    Run(served, random_prompt(served.model, WARMUP_TOKENS, 0), "off").wait()
    Run(served, random_prompt(served.model, WARMUP_TOKENS, 1), "always").wait()
    full = Run(served, random_prompt(served.model, n_tokens, 2), "off").wait()
    fast = Run(served, random_prompt(served.model, n_tokens, 3), "always").wait()
    return Calibration(n_tokens, full.ttft_s, fast.ttft_s)


def calibrate(served: Calibrated, min_speedup: float) -> Outcome | None:
    """Measure; the config to serve with has the auto threshold raised where PFlash did not win by
    `min_speedup` (a new config: the one being served is not rewritten)."""
    config = served.pflash
    n_tokens = calibration_length(config.threshold, served.max_ctx)
    if n_tokens is None:
        return None
    log.info("model %s: timing a %d-token prompt in full and with PFlash (pflash_calibrate)", served.name, n_tokens)
    calibration = measure(served, n_tokens)
    threshold = effective_threshold(config.threshold, calibration, min_speedup)
    if threshold == config.threshold:
        log.info("model %s: PFlash calibration: %s", served.name, calibration.describe())
        return Outcome(calibration, config)
    note = (f"raised from {config.threshold} at start: {calibration.describe()}, "
            f"under pflash_min_speedup {min_speedup}")
    log.warning("model %s: --pflash auto compresses only prompts over %d tokens: %s", served.name, threshold, note)
    return Outcome(calibration, replace(config, threshold=threshold, threshold_note=note))

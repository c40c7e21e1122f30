"""engine/intake.py driven with plain values (no model, no KV): the rules that end a generation as
its sampled tokens arrive, and the text they release."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.intake import Intake
from pflash_plugin.engine.live_text import LiveText
from pflash_plugin.engine.outbox import Outbox
from pflash_plugin.engine.request import (ErrorEvent, ErrorKind, Request, RequestRefused, RequestStatus,
                                          SamplingParams, TextEvent, TokenOutput)

EOG = 0
PIECES = {1: b"a", 2: b"b", 3: b" STOP", 4: b"c", 5: b"\xe2\x82", 6: b"\xac"}  # 5 + 6: the euro sign


class Ends:
    """What the scheduler would do with the ends Intake decides (Scheduler.finish / fail)."""

    def __init__(self) -> None:
        self.ends: list[tuple[int, RequestStatus, ErrorEvent | None]] = []
        self.failures: list[tuple[int, str]] = []

    def finish(self, request: Request, status: RequestStatus, error: ErrorEvent | None = None) -> None:
        request.status = status
        self.ends.append((request.request_id, status, error))

    def fail(self, request: Request, error: BaseException, what: str) -> None:
        request.status = RequestStatus.FINISHED_ERROR
        self.failures.append((request.request_id, what))


def make(**params) -> tuple[Intake, Ends, Outbox, Request]:
    ends, outbox = Ends(), Outbox(lambda request, error: None)
    text = LiveText(lambda token: PIECES[token], outbox)
    intake = Intake(text, lambda token: token == EOG, ends.finish, ends.fail)
    request = Request([9, 9], SamplingParams(**{"max_tokens": 8, **params}), sink=SEEN.append,
                      status=RequestStatus.DECODING, slot=0)
    text.start(request)
    return intake, ends, outbox, request


def texts(outbox: Outbox) -> str:
    """The text of the events delivered so far (each request's sink appends to `SEEN`)."""
    outbox.emit()
    return "".join(e.text for e in SEEN if isinstance(e, TextEvent))


SEEN: list[object] = []


@pytest.fixture(autouse=True)
def _seen():
    SEEN.clear()


def test_tokens_are_kept_and_their_text_waits_for_release():
    intake, ends, outbox, request = make()
    intake.take(request, TokenOutput(1), now=1.0)
    intake.take(request, TokenOutput(2), now=2.0)
    assert request.output_tokens == [1, 2] and not outbox
    assert (request.timings.first_token, request.timings.last_token) == (1.0, 2.0)
    intake.release([request])
    assert texts(outbox) == "ab" and not ends.ends


def test_max_tokens_ends_the_request_with_length_and_its_text_out():
    intake, ends, outbox, request = make(max_tokens=2)
    intake.take(request, TokenOutput(1), 0.0)
    intake.take(request, TokenOutput(4), 0.0)
    assert ends.ends == [(request.request_id, RequestStatus.FINISHED_LENGTH, None)]
    assert request.output_tokens == [1, 4] and texts(outbox) == "ac"


def test_end_of_generation_ends_with_stop_and_is_not_kept():
    intake, ends, _, request = make()
    intake.take(request, TokenOutput(1), 0.0)
    intake.take(request, TokenOutput(EOG), 0.0)
    assert request.output_tokens == [1]
    assert ends.ends == [(request.request_id, RequestStatus.FINISHED_STOP, None)]


def test_a_stop_string_among_accepted_drafts_ends_the_request_before_the_rest_are_kept():
    """Drafts 1, 3 accepted, then token 4: the stop string is in the second token's text."""
    intake, ends, outbox, request = make(stop=["STOP"])
    intake.take(request, TokenOutput(4, accepted=(1, 3)), 0.0)
    assert request.output_tokens == [1, 3]
    assert ends.ends == [(request.request_id, RequestStatus.FINISHED_STOP, None)]
    assert texts(outbox) == "a "


def test_a_token_split_across_utf8_pieces_is_released_whole():
    intake, _, outbox, request = make()
    intake.take(request, TokenOutput(5), 0.0)
    intake.release([request])
    assert texts(outbox) == ""
    intake.take(request, TokenOutput(6), 0.0)
    intake.release([request])
    assert texts(outbox) == "\u20ac"


def test_a_stop_string_in_released_text_finishes_the_request():
    intake, ends, _, request = make(stop=["STOP"])
    intake.take(request, TokenOutput(3), 0.0)
    assert not ends.ends
    intake.release([request])
    assert ends.ends == [(request.request_id, RequestStatus.FINISHED_STOP, None)]


def test_a_refused_row_is_the_client_s_error():
    intake, ends, _, request = make()
    intake.take(request, RequestRefused("too costly"), 0.0)
    (rid, status, error), = ends.ends
    assert (rid, status, error.kind, error.message) == (request.request_id, RequestStatus.FINISHED_REJECTED,
                                                        ErrorKind.INVALID, "too costly")


def test_a_sampling_error_fails_its_request_alone():
    intake, ends, outbox, request = make()
    other = Request([9], SamplingParams(max_tokens=8), sink=SEEN.append, status=RequestStatus.DECODING, slot=1)
    intake.text.start(other)
    intake.take(request, RuntimeError("boom"), 0.0)
    intake.take(other, TokenOutput(1), 0.0)
    assert ends.failures == [(request.request_id, "sampling")] and other.output_tokens == [1]


def test_a_text_failure_fails_that_request_alone():
    """A piece the detokenizer cannot give (here: an unknown token) fails its request, not the others."""
    intake, ends, outbox, request = make()
    other = Request([9], SamplingParams(max_tokens=8), sink=SEEN.append, status=RequestStatus.DECODING, slot=1)
    intake.text.start(other)
    intake.take(request, TokenOutput(77), 0.0)  # no piece for 77
    intake.take(other, TokenOutput(2), 0.0)
    intake.release([request, other])
    assert ends.failures == [(request.request_id, "releasing its text")]
    assert texts(outbox) == "b"

"""Fuzz a live server from its own OpenAPI schema (schemathesis + hypothesis): every answer must be
below 500, and no stream may carry a server_error event. Shared by tests/test_fuzz.py (bounded) and
bench/soak.py --fuzz_examples (longer)."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Finding:
    operation: str
    status: int | None  # None: no answer within the timeout, or the connection dropped
    body: object  # the request body schemathesis generated
    response: str


def server_error_event(response_text: str) -> bool:
    """An SSE stream (status 200) that reports a server error as its last event."""
    for line in response_text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            if isinstance(event.get("error"), dict) and event["error"].get("type") == "server_error":
                return True
    return False


def fuzz(url: str, max_examples: int, headers: dict[str, str] | None = None,
         timeout_s: float = 60.0) -> tuple[int, list[Finding]]:
    """Send up to `max_examples` generated cases per operation; returns (cases sent, server errors and
    requests with no answer within `timeout_s`)."""
    import requests
    import schemathesis
    from schemathesis import Case
    from schemathesis.core.result import Err
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=headers, timeout=timeout_s)
    findings: list[Finding] = []
    sent = 0
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # our own schema is not valid OpenAPI
        operation = result.ok()

        # no shrinking (every 5xx is recorded as it comes), no example database (reruns are alike)
        @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def send(case: Case) -> None:
            nonlocal sent
            sent += 1
            try:
                response = case.call(base_url=url, headers=headers, timeout=timeout_s)
            except requests.RequestException as error:
                findings.append(Finding(operation.label, None, case.body, repr(error)))
                return
            text = response.text
            # 501 is an answer, not a failure: a llama-server feature not served here says so, as llama-server
            # does without the option (POST /slots/{id} without --slot-save-path)
            failed = response.status_code >= 500 and response.status_code != 501
            if failed or (response.status_code == 200 and server_error_event(text)):
                findings.append(Finding(operation.label, response.status_code, case.body, text[:500]))

        send()
    return sent, findings

"""schemathesis against the live server's own OpenAPI document (``GET /openapi.json``): schema-valid
and schema-violating requests to every operation, a bounded number each. No response may be a
5xx, every status and content type must be documented, every schema-violating body must be
rejected (4xx), and no request may hang (60 s timeout)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from reliability_harness import LiveServer, assert_no_leaks

schemathesis = pytest.importorskip("schemathesis")
GenerationMode = schemathesis.GenerationMode
_checks = schemathesis.checks

POST_EXAMPLES = 60
"""Per generation endpoint and mode; the GET operations get GET_EXAMPLES."""
GET_EXAMPLES = 5
MAX_TOKENS_CAP = 8
"""Schema-valid bodies may ask for up to the whole context; cap generation so examples stay quick."""
CHECKS = [_checks.not_a_server_error, _checks.status_code_conformance, _checks.content_type_conformance,
          _checks.negative_data_rejection]


def _cap_generation(body: Any, limit: int) -> None:
    """Lower a schema-valid output length (absent, or up to the context ``limit``) to MAX_TOKENS_CAP;
    values outside the documented range stay, so schema-violating bodies stay schema-violating."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS_CAP < value < limit:
            body[name] = MAX_TOKENS_CAP
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS_CAP  # unset, chat would generate up to the whole context


# schemathesis's own pytest integration (schemathesis.pytest.from_fixture) needs pytest internals
# that pytest 9 removed, so each operation's strategy is driven by hypothesis directly.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_openapi_operations_never_5xx_or_hang(load_server: LiveServer, mode: str) -> None:
    limit = httpx.get(f"{load_server.base_url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    schema = schemathesis.openapi.from_url(f"{load_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    calls = 0
    for operation in operations:
        posts = operation.method.upper() == "POST"
        if mode == "negative" and not posts:
            continue  # the GET operations take nothing that could violate the schema
        examples = POST_EXAMPLES if posts else GET_EXAMPLES

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(GenerationMode(mode)))
        def run(case: Any) -> None:
            nonlocal calls
            _cap_generation(case.body, limit)
            case.call_and_validate(timeout=60, checks=CHECKS)
            calls += 1

        run()
    print("schemathesis calls", mode, calls)
    assert calls >= 2 * POST_EXAMPLES // 2, calls  # the generation endpoints were really exercised
    assert_no_leaks(load_server.base_url)

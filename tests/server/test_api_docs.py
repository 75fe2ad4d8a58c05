"""docs/api.md stays true: it documents every request field and every metric the server emits."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from gemmaserve.server.protocol import ChatCompletionRequest, CompletionRequest

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_every_request_field_is_documented() -> None:
    text = API_DOC.read_text()
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    missing = sorted(name for name in fields if f"`{name}`" not in text)
    assert not missing, f"document these request fields in docs/api.md: {missing}"


def test_every_metric_family_is_documented(ref: tuple[TestClient, object]) -> None:
    client, _ = ref
    assert client.post("/v1/completions", json={"prompt": "docs", "max_tokens": 2}).status_code == 200
    text = API_DOC.read_text()
    families = set(re.findall(r"^# TYPE (\S+) ", client.get("/metrics").text, flags=re.MULTILINE))
    assert len(families) >= 15
    missing = sorted(name for name in families if f"`{name}" not in text)
    assert not missing, f"document these metrics in docs/api.md: {missing}"

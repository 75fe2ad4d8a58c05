"""--api-key (Bearer auth with OpenAI's 401 body; /health and /metrics open) and JSON-only generation bodies
(a cross-site text/plain or form POST is refused with 415 before anything runs)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from server_harness import REFERENCE_MODEL as MODEL
from server_harness import reference_engine

from gemmaserve.server.app import create_app
from gemmaserve.settings import CoreSettings

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


@pytest.fixture
def guarded() -> Iterator[tuple[TestClient, object]]:
    engine = reference_engine()
    yield TestClient(create_app(engine, MODEL, api_key="s3cret"), raise_server_exceptions=False), engine
    engine.shutdown(timeout=10)


@pytest.mark.parametrize("header", [None, "Bearer wrong", "s3cret", "Bearer s3cret2", "bearer s3cret2", "Basic s3cret",
                                    "Bearers3cret", "Bearer", "s3cret Bearer"])
def test_a_wrong_or_missing_key_gets_openais_401(guarded, header) -> None:
    client, engine = guarded
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("post", "/v1/completions"), ("get", "/v1/models"), ("get", "/debug/kv")):
        response = getattr(client, method)(path, headers=headers, **({"json": BODY} if method == "post" else {}))
        assert response.status_code == 401, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["param"] is None
        assert "API key" in error["message"] and response.headers["www-authenticate"] == "Bearer"
    assert engine.stats().finished == {}  # nothing ran


def test_the_right_key_serves_and_health_and_metrics_stay_open(guarded) -> None:
    client, _ = guarded
    ok = {"Authorization": "Bearer s3cret"}
    assert client.post("/v1/completions", json=BODY, headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("header", ["bearer s3cret", "BEARER s3cret", "Bearer  s3cret", "bEaReR s3cret "])
def test_the_bearer_scheme_is_case_insensitive(guarded, header) -> None:
    """RFC 7235: the auth scheme is case-insensitive (and one or more spaces separate it from the token)."""
    client, _ = guarded
    assert client.post("/v1/completions", json=BODY, headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                  "text/plain;charset=UTF-8"])
def test_non_json_generation_bodies_are_refused_before_they_run(make_client, kind) -> None:
    client, engine = make_client()
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = client.post(path, content=json.dumps(BODY), headers={"content-type": kind})
        assert response.status_code == 415, response.text
        assert response.json()["error"]["code"] == "unsupported_media_type"
        assert kind.split(";")[0] in response.json()["error"]["message"]
    assert engine.stats().finished == {}
    ok = client.post("/v1/completions", content=json.dumps(BODY), headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_the_key_comes_from_api_key_or_vllm_api_key(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert CoreSettings().api_key == "from-vllm"
    monkeypatch.setenv("API_KEY", "ours")
    assert CoreSettings().api_key == "ours"
    monkeypatch.delenv("API_KEY")
    monkeypatch.delenv("VLLM_API_KEY")
    assert CoreSettings().api_key is None


def test_only_allowed_host_headers_are_served() -> None:
    """Bound to loopback, the server answers only loopback Host names (a DNS-rebinding page's own name is
    refused) plus --allowed-hosts; bound elsewhere without --allowed-hosts, any."""
    from gemmaserve.server.serve import allowed_hosts

    hosts = allowed_hosts(CoreSettings(host="127.0.0.1", allowed_hosts="gpu-box.internal"))
    assert hosts is not None and {"localhost", "127.0.0.1", "::1", "gpu-box.internal"} <= set(hosts)
    assert allowed_hosts(CoreSettings(host="0.0.0.0")) is None
    assert allowed_hosts(CoreSettings(host="0.0.0.0", allowed_hosts="a.example, b.example")) == ["a.example", "b.example"]
    engine = reference_engine()
    try:
        client = TestClient(create_app(engine, MODEL, allowed_hosts=hosts), raise_server_exceptions=False)
        for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "GPU-BOX.internal:80"):
            assert client.get("/health", headers={"host": host}).status_code == 200, host
        for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example", ""):
            response = client.post("/v1/completions", json=BODY, headers={"host": host})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host", host
        assert engine.stats().finished == {}
    finally:
        engine.shutdown(timeout=10)


def test_cors_is_off_unless_origins_are_given_and_debug_pages_need_the_flag() -> None:
    engine = reference_engine()
    try:
        plain = TestClient(create_app(engine, MODEL, debug_endpoints=False), raise_server_exceptions=False)
        origin = {"origin": "https://app.example"}
        assert "access-control-allow-origin" not in plain.get("/v1/models", headers=origin).headers
        for path in ("/debug/kv", "/docs", "/redoc"):
            assert plain.get(path).status_code == 404, path
        assert plain.get("/openapi.json").status_code == 200
        cors = TestClient(create_app(engine, MODEL, allowed_origins=["https://app.example"]),
                          raise_server_exceptions=False)
        assert cors.get("/v1/models", headers=origin).headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in cors.get("/v1/models", headers={"origin": "https://evil.example"}).headers
        assert cors.get("/debug/kv").status_code == 200 and cors.get("/docs").status_code == 200
    finally:
        engine.shutdown(timeout=10)

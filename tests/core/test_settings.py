"""Settings: env names from the seed, validation errors that list accepted values."""

from __future__ import annotations

import pytest

from gemmaserve.errors import ConfigurationError
from gemmaserve.settings import load_settings


def test_env_names_are_the_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKEND", "Custom_CPU")
    monkeypatch.setenv("DEVICE", "CPU")
    monkeypatch.setenv("MAX_ACTIVE_KV_TOKENS", "1234")
    monkeypatch.setenv("MODEL", "/some/model")
    settings = load_settings()
    assert settings.backend == "custom-cpu"
    assert settings.device == "cpu"
    assert settings.max_active_kv_tokens == 1234
    assert settings.model == "/some/model"


def test_prefixed_alias_and_flag_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMMASERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("PORT", "9000")
    settings = load_settings(port=9100, model=None)
    assert settings.max_batch_size == 7
    assert settings.port == 9100


@pytest.mark.parametrize("name, value", [("GEMMASERVE_MAX_BATCH_SIZE", "abc"), ("VLLM_API_KEY", ""),
                                         ("GEMMASERVE_DEVICE", "tpu"), ("MAX_BATCH_SIZE", "-3")])
def test_a_bad_value_is_reported_under_the_name_it_was_set_as(monkeypatch: pytest.MonkeyPatch, name: str,
                                                              value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=rf"\n  {name}={value!r}: "):
        load_settings()


def test_dotenv_file_is_read(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text("KV_BLOCK_SIZE=32\n")
    monkeypatch.chdir(tmp_path)
    assert load_settings().kv_block_size == 32


@pytest.mark.parametrize(
    ("env", "value", "expected_fragment"),
    [
        ("DEVICE", "tpu", "'auto', 'cpu', 'cuda' or 'mps'"),
        ("MAX_ACTIVE_KV_TOKENS", "0", "greater than or equal to 1"),
        ("DTYPE", "int8", "'float32'"),
        ("PORT", "not-a-port", "valid integer"),
    ],
)
def test_invalid_values_name_field_and_accepted(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, expected_fragment: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    message = str(info.value)
    assert env in message
    assert expected_fragment in message


def test_connection_settings_take_uvicorn_and_vllm_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "7.5")
    monkeypatch.setenv("LIMIT_CONCURRENCY", "12")
    settings = load_settings()
    assert settings.timeout_keep_alive == 7.5 and settings.limit_concurrency == 12
    assert (settings.client_header_timeout, settings.client_body_timeout) == (10.0, 60.0)
    with pytest.raises(ConfigurationError, match="CLIENT_BODY_TIMEOUT"):
        load_settings(client_body_timeout=0)


def test_shutdown_timeout_default_and_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().shutdown_timeout == 10.0
    monkeypatch.setenv("SHUTDOWN_TIMEOUT", "0")
    assert load_settings().shutdown_timeout == 0.0
    with pytest.raises(ConfigurationError, match="SHUTDOWN_TIMEOUT"):
        load_settings(shutdown_timeout=-1)


@pytest.mark.parametrize("host", ["", " ", "\t"])
def test_a_blank_bind_address_is_refused(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """HOST= (a blank line in a .env or a container template) used to listen on every interface."""
    monkeypatch.setenv("HOST", host)
    with pytest.raises(ConfigurationError, match="HOST=.*the bind address is empty"):
        load_settings()
    with pytest.raises(ConfigurationError, match="the bind address is empty"):
        load_settings(host=host)


def test_a_dotenv_that_is_not_utf8_is_a_configuration_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_bytes(b"MAX_BATCH_SIZE=2\n\xff\xfe=1\n")
    with pytest.raises(ConfigurationError, match="cannot read settings from .env: it is not UTF-8"):
        load_settings()


def test_two_spellings_of_one_setting_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """BACKEND and GEMMASERVE_BACKEND (or API_KEY and VLLM_API_KEY) set to different values: refused, naming
    both and no value (a key is a secret); the same value twice is fine."""
    monkeypatch.setenv("BACKEND", "custom-cpu")
    monkeypatch.setenv("GEMMASERVE_BACKEND", "hf")
    with pytest.raises(ConfigurationError, match="BACKEND and GEMMASERVE_BACKEND; set only one"):
        load_settings()
    monkeypatch.setenv("GEMMASERVE_BACKEND", "custom-cpu")
    assert load_settings().backend == "custom-cpu"
    monkeypatch.setenv("API_KEY", "first-secret")
    monkeypatch.setenv("VLLM_API_KEY", "second-secret")
    with pytest.raises(ConfigurationError, match="API_KEY and VLLM_API_KEY") as refused:
        load_settings()
    assert "secret" not in str(refused.value)


def test_a_misspelt_gemmaserve_variable_stops_build_engine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMMASERVE_* names no installed settings class reads are refused before any model loads, from the
    environment and from .env, with the closest accepted name; the plugins' own GEMMASERVE_ names are accepted."""
    from gemmaserve.engine.factory import build_engine

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GEMMASERVE_COMPILE_MODEL", "0")  # hf_torch's setting: known through its BackendSpec
    monkeypatch.setenv("GEMMASERVE_MAX_BATCH_SIZ", "8")
    with pytest.raises(ConfigurationError, match=r"GEMMASERVE_MAX_BATCH_SIZ is not a setting \(did you mean "
                                                 r"GEMMASERVE_MAX_BATCH_SIZE\?\)") as caught:
        build_engine(load_settings(backend="custom-cpu", model=str(tmp_path / "absent")))
    assert "GEMMASERVE_COMPILE_MODEL is not" not in str(caught.value)
    monkeypatch.delenv("GEMMASERVE_MAX_BATCH_SIZ")
    (tmp_path / ".env").write_text("GEMMASERVE_DEVISE=cpu\n")
    with pytest.raises(ConfigurationError, match="GEMMASERVE_DEVISE is not a setting"):
        build_engine(load_settings(backend="custom-cpu", model=str(tmp_path / "absent")))


def test_every_settings_field_is_accepted_under_its_gemmaserve_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemmaserve.engine.factory import _settings_classes
    from gemmaserve.plugins import load_registry
    from gemmaserve.settings import check_gemmaserve_variables, env_names

    classes = _settings_classes(load_registry())
    assert classes is not None
    names = {name for cls in classes for name in env_names(cls) if name.startswith("GEMMASERVE_")}
    assert {"GEMMASERVE_BACKEND", "GEMMASERVE_COMPILE_MODEL", "GEMMASERVE_HF_ATTN_IMPLEMENTATION"} <= names
    for name in names:
        monkeypatch.setenv(name, "x")
    check_gemmaserve_variables(classes)  # the values are not checked here, only the names

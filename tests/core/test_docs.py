"""Docs stay true: every core setting is documented in docs/settings.md."""

from __future__ import annotations

from pathlib import Path

from gemmaserve.settings import CoreSettings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_core_setting_is_documented() -> None:
    text = (DOCS / "settings.md").read_text()
    missing = [name.upper() for name in CoreSettings.model_fields if f"`{name.upper()}`" not in text]
    assert not missing, f"document these settings in docs/settings.md: {missing}"


def _plugin_env_names() -> list[str]:
    """Env names of every installed plugin's settings (prefix + field, or its validation aliases)."""
    import importlib

    names: list[str] = []
    for module_name, class_name in (
        ("gemmaserve_custom_torch.settings", "CustomTorchSettings"),
        ("gemmaserve_hf_torch.settings", "HFTorchSettings"),
        ("gemmaserve_mlx.settings", "MlxSettings"),
    ):
        try:
            settings_class = getattr(importlib.import_module(module_name), class_name)
        except ImportError:
            continue
        prefix = settings_class.model_config.get("env_prefix", "")
        for name, field in settings_class.model_fields.items():
            aliases = getattr(field.validation_alias, "choices", None)
            names.append(str(aliases[0]) if aliases else f"{prefix}{name}".upper())
    return names


def test_every_plugin_setting_is_documented() -> None:
    text = (DOCS / "settings.md").read_text()
    missing = [name for name in _plugin_env_names() if f"`{name}`" not in text]
    assert not missing, f"document these plugin settings in docs/settings.md: {missing}"


def test_the_license_file_is_the_apache_2_license_the_metadata_names() -> None:
    import hashlib
    import re

    root = DOCS.parent
    text = (root / "LICENSE").read_text()
    # the canonical https://www.apache.org/licenses/LICENSE-2.0.txt, byte for byte
    assert hashlib.sha256(text.encode()).hexdigest() == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
    for pyproject in [root / "pyproject.toml", *sorted((root / "plugins").glob("*/pyproject.toml"))]:
        assert re.search(r'^license = "Apache-2.0"$', pyproject.read_text(), re.M), pyproject
    assert "[LICENSE](LICENSE)" in (root / "README.md").read_text()

"""Docs stay true: every core setting is documented in docs/settings.md."""

from __future__ import annotations

from pathlib import Path

from gemmaserve.settings import CoreSettings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_core_setting_is_documented() -> None:
    text = (DOCS / "settings.md").read_text()
    missing = [name.upper() for name in CoreSettings.model_fields if f"`{name.upper()}`" not in text]
    assert not missing, f"document these settings in docs/settings.md: {missing}"

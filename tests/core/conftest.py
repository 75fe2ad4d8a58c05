"""Fixtures shared by the core tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gemmaserve import BackendSpec, hookimpl
from gemmaserve.plugins import register_plugin, unregister_plugin


def _plugin(*specs: BackendSpec) -> object:
    class Plugin:
        @hookimpl
        def gemmaserve_register_backends(self, register: Callable[[BackendSpec], None]) -> None:
            for spec in specs:
                register(spec)

    return Plugin()


@pytest.fixture
def fake_plugins() -> Iterator[Callable[..., None]]:
    """``add(name, *specs)``: a plugin registering ``specs`` under ``name``, unregistered after the test."""
    names: list[str] = []

    def add(name: str, *specs: BackendSpec) -> None:
        register_plugin(_plugin(*specs), name)
        names.append(name)

    yield add
    for name in names:
        unregister_plugin(name)

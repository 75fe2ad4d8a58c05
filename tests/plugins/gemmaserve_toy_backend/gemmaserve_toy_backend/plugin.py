"""Entry-point module: registers the ``toy`` backend. Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Callable

from gemmaserve import BackendSpec, hookimpl


@hookimpl
def gemmaserve_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(
        BackendSpec(
            name="toy",
            factory="gemmaserve_toy_backend.backend:create_backend",
            devices=("cpu",),
            priority=1000,  # never the automatic choice; select it with BACKEND=toy
            description="deterministic toy model (example third-party plugin)",
            requires_model=False,
        )
    )

"""Entry-point module: registers the ``faulty`` backend. Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Callable

from gemmaserve import BackendSpec, hookimpl


@hookimpl
def gemmaserve_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(
        BackendSpec(
            name="faulty",
            factory="gemmaserve_fault_backend.backend:create_backend",
            devices=("cpu",),
            priority=1000,  # never the automatic choice; select it with BACKEND=faulty
            description="test-only: wraps FAULT_INNER_BACKEND (default custom-cpu) and injects faults",
        )
    )

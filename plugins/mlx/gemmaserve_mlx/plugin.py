"""Entry point of the ``gemmaserve-mlx`` distribution: registers ``mlx`` and ``mlx-stream``.

Imports nothing heavy: factories and probes are dotted paths resolved only when needed.
"""

from __future__ import annotations

from collections.abc import Callable

from gemmaserve import BackendSpec, hookimpl

__all__ = ["gemmaserve_register_backends", "BATCH_SPEC", "STREAM_SPEC"]

BATCH_SPEC = BackendSpec(
    name="mlx",
    factory="gemmaserve_mlx.batch_backend:create_backend",
    devices=("mps", "cpu"),
    probe="gemmaserve_mlx.probe:probe_batch",
    priority=20,
    settings="gemmaserve_mlx.settings:MlxSettings",
    description="MLX continuous batching: batched decode over left-padded KV, core prefix cache.",
)

STREAM_SPEC = BackendSpec(
    name="mlx-stream",
    factory="gemmaserve_mlx.stream_backend:create_backend",
    devices=("mps", "cpu"),
    probe="gemmaserve_mlx.probe:probe_stream",
    priority=80,
    settings="gemmaserve_mlx.settings:MlxSettings",
    description="MLX streaming-only (mlx_lm generate_step), one request at a time, per-session KV reuse.",
)


@hookimpl
def gemmaserve_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BATCH_SPEC)
    register(STREAM_SPEC)

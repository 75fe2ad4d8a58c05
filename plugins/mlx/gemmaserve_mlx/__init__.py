"""gemmaserve backends on Apple MLX: ``mlx`` (continuous batching) and ``mlx-stream`` (streaming-only).

Importing this package is light: it never imports mlx, mlx_lm, torch or transformers. The backend
modules (``batch_backend``, ``stream_backend``) import mlx when the registry resolves their factory.
"""

from __future__ import annotations

__all__: list[str] = []

"""The core backend conformance suite (gemmaserve.testing.BackendContractTests) for both MLX backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlx_helpers import batch_backend, stream_backend

from gemmaserve.backend import InferenceBackend
from gemmaserve.testing.backend_contract import BackendContractTests


class TestMlxBatchGemma4Contract(BackendContractTests):
    """BACKEND=mlx on Gemma 4 (sliding window 8, so the long prompts exercise the window); a KV growth
    of 3 columns makes the batch drop out-of-window columns every few steps."""

    @pytest.fixture
    def backend(self, gemma4_dir: Path) -> Iterator[InferenceBackend]:
        backend = batch_backend(gemma4_dir, kv_growth=3)
        yield backend
        backend.close()


class TestMlxBatchLlamaContract(BackendContractTests):
    """BACKEND=mlx on a Llama-style model (full attention only, untied head)."""

    property_examples = 8

    @pytest.fixture
    def backend(self, checkpoint: Callable[[str], Path]) -> Iterator[InferenceBackend]:
        backend = batch_backend(checkpoint("llama"))
        yield backend
        backend.close()


class TestMlxStreamContract(BackendContractTests):
    """BACKEND=mlx-stream (streaming-only: the batched-primitive tests skip themselves)."""

    expects_prefix_hits = False

    @pytest.fixture
    def backend(self, gemma4_dir: Path) -> Iterator[InferenceBackend]:
        backend = stream_backend(gemma4_dir)
        yield backend
        backend.close()

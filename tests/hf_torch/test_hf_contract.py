"""The core backend conformance suite, run against the hf backend for both model families."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gemmaserve.testing.backend_contract import BackendContractTests
from gemmaserve_hf_torch.backend import HFTorchBackend
from gemmaserve_hf_torch.loader import LoadedModel


class TestHFGemma4Contract(BackendContractTests):
    """Tiny Gemma 4 (sliding window 8 < the longest prompt, KV-shared layers)."""

    @pytest.fixture
    def backend(self, gemma4_loaded: LoadedModel) -> Iterator[HFTorchBackend]:
        backend = HFTorchBackend(gemma4_loaded)
        yield backend
        backend.close()


class TestHFLlamaContract(BackendContractTests):
    """Tiny Llama-style model."""

    property_examples = 8

    @pytest.fixture
    def backend(self, llama_loaded: LoadedModel) -> Iterator[HFTorchBackend]:
        backend = HFTorchBackend(llama_loaded)
        yield backend
        backend.close()

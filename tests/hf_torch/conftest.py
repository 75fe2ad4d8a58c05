"""Fixtures for the hf_torch tests: tiny checkpoints (built once per session), loaded models
(once per session) and fresh backends over them (per test). CPU, float32, no network."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_checkpoints import build_gemma4_checkpoint, build_llama_checkpoint  # noqa: E402
from hf_support import cpu_settings, hf_settings  # noqa: E402

from gemmaserve_hf_torch.backend import HFTorchBackend  # noqa: E402
from gemmaserve_hf_torch.loader import LoadedModel, load_model  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models are dominated by OpenMP synchronisation: one intra-op thread is several times
    faster on a loaded 2-core CI box. Restored after each test (torch's setting is process-wide)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_checkpoints import shared_checkpoints

    return shared_checkpoints().build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def gemma3_loaded(gemma3_dir: Path) -> LoadedModel:
    return load_model(str(gemma3_dir), "cpu", cpu_settings(), hf_settings())


@pytest.fixture(scope="session")
def gemma4_loaded(gemma4_dir: Path) -> LoadedModel:
    return load_model(str(gemma4_dir), "cpu", cpu_settings(), hf_settings())


@pytest.fixture(scope="session")
def llama_loaded(llama_dir: Path) -> LoadedModel:
    return load_model(str(llama_dir), "cpu", cpu_settings(), hf_settings())


def _fresh(loaded: LoadedModel) -> Iterator[HFTorchBackend]:
    backend = HFTorchBackend(loaded)
    yield backend
    backend.check_integrity()
    assert backend.num_live_rows == 0, "a test leaked row KV (neither freed nor spliced)"
    if backend.cache_manager is not None:
        assert backend.cache_manager.stats().pinned_blocks == 0, "prefix-cache blocks left pinned"
    backend.close()


@pytest.fixture
def gemma4_backend(gemma4_loaded: LoadedModel) -> Iterator[HFTorchBackend]:
    """A fresh backend (no prefix cache) over the session's tiny Gemma 4."""
    yield from _fresh(gemma4_loaded)


@pytest.fixture
def llama_backend(llama_loaded: LoadedModel) -> Iterator[HFTorchBackend]:
    """A fresh backend (no prefix cache) over the session's tiny Llama."""
    yield from _fresh(llama_loaded)


@pytest.fixture(params=["gemma4", "llama", "gemma3"])
def any_backend(request: pytest.FixtureRequest) -> Iterator[HFTorchBackend]:
    """Each test runs once per model family (Gemma 3: sliding window 8, one head dim, no sharing)."""
    yield from _fresh(request.getfixturevalue(f"{request.param}_loaded"))

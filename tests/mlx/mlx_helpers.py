"""Helpers of the MLX tests: settings, cached model loads, a scheduler driver, references."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gemmaserve.engine.request import Request, RequestOutput
from gemmaserve.engine.scheduler import ContinuousBatchScheduler
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import CoreSettings, load_settings

from gemmaserve_mlx.batch_backend import MlxBatchBackend
from gemmaserve_mlx.loader import LoadedModel, load_model
from gemmaserve_mlx.settings import load_mlx_settings
from gemmaserve_mlx.stream_backend import MlxStreamBackend

__all__ = [
    "settings_for",
    "loaded",
    "batch_backend",
    "stream_backend",
    "Arrival",
    "run_scheduled",
    "mlx_lm_greedy",
    "hf_greedy",
]


def settings_for(model: Path | None = None, *, backend: str = "mlx", **overrides: object) -> CoreSettings:
    """Core settings selecting an MLX backend explicitly, on the CPU, in float32."""
    values: dict[str, object] = {"backend": backend, "device": "cpu", "dtype": "float32"}
    if model is not None:
        values["model"] = str(model)
    values.update(overrides)
    return load_settings(**values)


@functools.cache
def loaded(model: Path) -> LoadedModel:
    """The model loaded once per session (mlx_lm models are stateless; backends hold the KV)."""
    return load_model(model, "cpu", settings_for(model))


def batch_backend(model: Path, *, kv_growth: int = 256) -> MlxBatchBackend:
    """A fresh BACKEND=mlx instance over the session's loaded model."""
    return MlxBatchBackend(loaded(model), load_mlx_settings(kv_growth=kv_growth))


def stream_backend(model: Path, *, prompt_caches: int = 4) -> MlxStreamBackend:
    """A fresh BACKEND=mlx-stream instance over the session's loaded model."""
    return MlxStreamBackend(loaded(model), load_mlx_settings(stream_prompt_caches=prompt_caches))


@dataclass(frozen=True, slots=True)
class Arrival:
    """Request ``request_id`` with ``prompt``/``params`` arrives before scheduler tick ``tick``."""

    tick: int
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams


def run_scheduled(
    backend: object,
    arrivals: Sequence[Arrival],
    *,
    cache: CacheManager | None = None,
    settings: CoreSettings | None = None,
    max_ticks: int = 10_000,
) -> dict[str, RequestOutput]:
    """Drive the core ContinuousBatchScheduler until every request finished; checks the scheduler's
    integrity each tick. Returns the final outputs by request id."""
    scheduler = ContinuousBatchScheduler(backend, settings or settings_for(), cache)  # type: ignore[arg-type]
    pending = sorted(arrivals, key=lambda a: a.tick)
    outputs: dict[str, RequestOutput] = {}
    for tick in range(max_ticks):
        while pending and pending[0].tick <= tick:
            arrival = pending.pop(0)
            scheduler.add_request(Request(arrival.request_id, arrival.prompt, arrival.params))
        for event in scheduler.step():
            if event.finished:
                assert event.output is not None
                outputs[event.request_id] = event.output
        scheduler.check_integrity()
        if not pending and not scheduler.has_work:
            return outputs
    raise AssertionError(f"requests still running after {max_ticks} ticks")


def mlx_lm_greedy(model_dir: Path, prompt: Sequence[int], max_tokens: int, *, stop_at_eos: bool = True) -> list[int]:
    """Greedy tokens of mlx_lm's own generation loop and caches (KVCache / RotatingKVCache) over the
    model as the plugin loads it (same weights and config fixes): ``stream_generate``, which
    ``mlx_lm.generate`` prints, stops at EOS (included); ``generate_step`` does not stop."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.generate import generate_step

    model = loaded(model_dir)
    if not stop_at_eos:
        steps = generate_step(mx.array(list(prompt)), model.model, max_tokens=max_tokens)
        return [token for token, _ in steps]
    wrapper = model.tokenizer._wrapper
    return [response.token for response in stream_generate(model.model, wrapper, list(prompt), max_tokens=max_tokens)]


@functools.cache
def _hf_model(model_dir: Path) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="float32").eval()


def hf_greedy(model_dir: Path, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` on the same checkpoint (stops at EOS, EOS included)."""
    import torch

    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([list(prompt)]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()

"""Loading a local Hugging Face causal LM onto a device, and calling its forward.

- :func:`resolve_dtype`: ``DTYPE=auto`` is bfloat16 on CUDA (float16 on GPUs without bf16), bfloat16 on CPUs
  with bfloat16 matmul instructions (AVX512_BF16 or AMX, :func:`~gemmaserve.hardware.cpu_has_native_bfloat16`),
  float32 on other CPUs and on MPS. float16 is chosen only on CUDA GPUs without bfloat16 (Gemma activations can
  overflow it: DTYPE=float32 there).
- :func:`load_model`: validates the directory (config.json, weights, architecture, dtype) and loads
  model + tokenizer, raising :class:`~gemmaserve.errors.ModelLoadError` with what is wrong.
- ``QUANTIZATION=int8`` (CPU): every ``nn.Linear`` becomes an :class:`~gemmaserve_hf_torch.int8.Int8Linear`
  after loading (int8 weights per output channel, int8 activations per token, batch-invariant).
- :class:`ModelForward`: the forward used by the backend, optionally through ``torch.compile``
  (``COMPILE_MODEL``) with a warning and a permanent fall back to eager if compiling fails.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gemmaserve.errors import ConfigurationError, ModelLoadError
from gemmaserve.hardware import cpu_has_native_bfloat16, device_unavailable_reason
from gemmaserve.models.gemma_defaults import bidirectional_problem
from gemmaserve_hf_torch.probe import model_dir_problem
from gemmaserve_hf_torch.tokenizer import HFTokenizer, load_tokenizer

if TYPE_CHECKING:
    from transformers import DynamicCache

    from gemmaserve.settings import CoreSettings
    from gemmaserve_hf_torch.settings import HFTorchSettings

__all__ = ["LoadedModel", "ModelForward", "load_model", "resolve_dtype", "check_dtype_runs"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(setting: str, device: str) -> torch.dtype:
    """The torch dtype for ``DTYPE=setting`` on ``device`` (see the module docstring for ``auto``)."""
    if setting != "auto":
        if setting not in _DTYPES:
            raise ConfigurationError(f"DTYPE={setting!r} is not accepted; use auto, float32, bfloat16 or float16")
        return _DTYPES[setting]
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device == "cpu" and cpu_has_native_bfloat16():
        return torch.bfloat16
    return torch.float32


def check_dtype_runs(dtype: torch.dtype, device: torch.device) -> None:
    """Raise ModelLoadError if a matmul + softmax in ``dtype`` fails on ``device`` here."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError("DTYPE=bfloat16 is not supported by this CUDA GPU; use float16 or float32")
    try:
        _run_dtype_probe(dtype, device)
    except Exception as exc:
        name = str(dtype).removeprefix("torch.")
        raise ModelLoadError(
            f"DTYPE={name} does not run on {device.type} with this torch build ({type(exc).__name__}: {exc}); "
            "use DTYPE=float32 (or auto)"
        ) from None


def _run_dtype_probe(dtype: torch.dtype, device: torch.device) -> None:
    a = torch.ones(4, 4, dtype=dtype, device=device)
    torch.softmax(a @ a, dim=-1).sum().item()


class ModelForward:
    """Calls the model's forward, through ``torch.compile`` when asked.

    Atomic with respect to the cache: if a call raises, every cache layer is put back as it was.
    If compiling or a compiled call fails, logs a warning once, switches to eager for good and
    retries the failed call eagerly.
    """

    def __init__(self, model: torch.nn.Module, *, compile_model: bool) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._compiled: Any = None
        if compile_model:
            try:
                self._compiled = torch.compile(model)
            except Exception as exc:
                self._fall_back(exc)

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        cache: DynamicCache,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [batch, positions, vocab] (positions = 1 with ``last_only``). Appends the new
        tokens' KV to ``cache`` (mutated)."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            self._cache_kwarg: cache,
            "use_cache": True,
        }
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        saved = [dict(vars(layer)) for layer in cache.layers]  # references only: layers rebind on update
        if self._compiled is not None:
            try:
                return self._logits(self._compiled(**kwargs), last_only)
            except Exception as exc:
                _restore(cache, saved)
                self._fall_back(exc)
        try:
            return self._logits(self.model(**kwargs), last_only)
        except BaseException:
            _restore(cache, saved)
            raise

    @staticmethod
    def _logits(output: Any, last_only: bool) -> torch.Tensor:
        logits = output.logits
        return logits[:, -1:, :] if last_only else logits

    def _fall_back(self, exc: BaseException) -> None:
        self._compiled = None
        logger.warning(
            "COMPILE_MODEL: torch.compile failed for %s (%s: %s); falling back to eager execution",
            type(self.model).__name__,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )


def _restore(cache: DynamicCache, saved: list[dict[str, Any]]) -> None:
    """Put every layer of ``cache`` back to the attribute state captured in ``saved``."""
    for layer, state in zip(cache.layers, saved):
        vars(layer).clear()
        vars(layer).update(state)


@dataclass(slots=True)
class LoadedModel:
    """A model ready to serve: eval mode on ``device`` in ``dtype``, with its tokenizer."""

    path: Path
    model: torch.nn.Module
    forward: ModelForward
    tokenizer: HFTokenizer
    text_config: Any
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def load_model(model_path: str, device: str, settings: CoreSettings, hf_settings: HFTorchSettings) -> LoadedModel:
    """Load the checkpoint directory ``model_path`` onto ``device``. Raises ModelLoadError (bad
    directory, architecture or dtype) or ConfigurationError (no context length known)."""
    path = Path(model_path).expanduser()
    problem = model_dir_problem(path, trust_remote_code=hf_settings.trust_remote_code) or device_unavailable_reason(device)
    if problem is not None:
        raise ModelLoadError(problem)
    problem = bidirectional_problem(json.loads((path / "config.json").read_text(encoding="utf-8")))
    if problem is not None:  # a model problem, not the device's (the probe's problems read as the latter)
        raise ModelLoadError(problem)
    torch_device = torch.device(device)
    dtype = resolve_dtype(settings.dtype, device)
    check_dtype_runs(dtype, torch_device)
    tokenizer = load_tokenizer(path, trust_remote_code=hf_settings.trust_remote_code)
    from transformers import AutoModelForCausalLM

    attention = hf_settings.hf_attn_implementation
    chosen = "hf_attn_implementation" in hf_settings.model_fields_set
    while True:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path),
                dtype=dtype,
                attn_implementation=attention,
                local_files_only=True,
                trust_remote_code=hf_settings.trust_remote_code,
            )
            break
        except Exception as exc:
            no_sdpa = attention == "sdpa" and "scaled_dot_product_attention" in str(exc)
            if no_sdpa and not chosen:  # the default, not the user's choice: the architecture's own attention
                logger.warning("hf: %s does not support sdpa attention; loading it with eager attention (set "
                               "HF_ATTN_IMPLEMENTATION=eager to skip this attempt)", path.name)
                attention = "eager"
                continue
            hint = ("; a weight file is probably truncated or corrupt (an interrupted download or copy): fetch or "
                    "convert it again") if "safetensor" in type(exc).__name__.lower() else ""
            if no_sdpa:
                hint = "; set HF_ATTN_IMPLEMENTATION=eager"
            raise ModelLoadError(
                f"transformers could not load {str(path)!r}: {type(exc).__name__}: {exc}{hint}") from None
    model = model.to(torch_device).eval()
    problem = _left_padding_problem(model, torch_device)
    if problem is not None:
        raise ModelLoadError(problem)
    if settings.quantization == "int8":
        from gemmaserve_hf_torch.int8 import int8_unavailable_reason, quantize_linears

        problem = int8_unavailable_reason(device)
        if problem is not None:
            raise ConfigurationError(problem)
        replaced = quantize_linears(model)
        logger.info("hf: QUANTIZATION=int8: %d linear layers run as int8 x int8 (fbgemm)", replaced)
    text_config = model.config.get_text_config(decoder=True)
    return LoadedModel(
        path=path,
        model=model,
        forward=ModelForward(model, compile_model=hf_settings.compile_model),
        tokenizer=tokenizer,
        text_config=text_config,
        dtype=dtype,
        device=torch_device,
        max_model_len=_max_model_len(text_config, settings),
        eos_token_ids=_eos_token_ids(model, tokenizer),
    )


def _left_padding_problem(model: torch.nn.Module, device: torch.device) -> str | None:
    """Rows of a batch are left-padded and get their positions through ``position_ids``. A model whose forward
    takes none (Bart, Marian, Pegasus... as causal LMs) counts positions itself from the sequence, so padding
    would shift them; one that derives them from the attention mask (ALiBi: Bloom, MPT) is fine. Checked by
    running two tokens with and without a padding token before them."""
    if "position_ids" in inspect.signature(model.forward).parameters:
        return None
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = torch.tensor([[3 % vocab, 5 % vocab]], device=device)
    padded_ids = torch.tensor([[0, 3 % vocab, 5 % vocab]], device=device)
    try:
        with torch.inference_mode():
            plain = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
            padded = model(input_ids=padded_ids, attention_mask=torch.tensor([[0, 1, 1]], device=device)).logits
    except Exception as exc:
        return (f"{type(model).__name__} takes no position_ids and could not run a left-padded batch "
                f"({type(exc).__name__}: {exc}); the hf backend batches rows with left padding, so it cannot serve it")
    difference = float((padded[0, -1].float() - plain).abs().max())
    if difference <= 1e-2 * float(plain.abs().max()) + 1e-3:
        return None
    return (f"{type(model).__name__} takes no position_ids: it counts positions itself, so the left padding of "
            f"a batch would shift them (its logits change by {difference:.3g} with one padding token); the hf backend "
            "batches rows that way and cannot serve this architecture")


def _max_model_len(text_config: Any, settings: CoreSettings) -> int:
    """The context served: ``max_position_embeddings`` (or ``MAX_MODEL_LEN`` when lower), within
    :func:`_batch_invariant_length`; a ``MAX_MODEL_LEN`` beyond that bound is a ConfigurationError naming it."""
    model_limit = getattr(text_config, "max_position_embeddings", None)
    if isinstance(model_limit, int) and model_limit > 0:
        limit = min(model_limit, settings.max_model_len) if settings.max_model_len else model_limit
    elif settings.max_model_len:
        limit = settings.max_model_len
    else:
        raise ConfigurationError("the model's config.json has no max_position_embeddings; set MAX_MODEL_LEN")
    bound = _batch_invariant_length(text_config)
    if bound is None or limit <= bound[0]:
        return limit
    most, why = bound
    if settings.max_model_len:
        raise ConfigurationError(f"MAX_MODEL_LEN={settings.max_model_len} is more than the hf backend serves this "
                                 f"model exactly: {why}; set MAX_MODEL_LEN to at most {most}")
    logger.warning("hf: serving a context of %d tokens instead of %d: %s", most, limit, why)
    return most


def _batch_invariant_length(text_config: Any) -> tuple[int, str] | None:
    """The longest context over which this model's tokens do not depend on the rest of the batch, the prefill
    chunking or the prefix cache, and why (None: no such bound). transformers computes some position-dependent
    factors from the whole forward call's positions, where the hf backend runs many rows, or one chunk of a prompt,
    per call: a ``longrope`` / ``dynamic`` RoPE picks its factors from the largest position in the call (below the
    original length the short, unscaled ones), and Llama 4's attention-temperature tuning on its NoPE layers reads
    the padded cache length. Within the bound each sees the values of a single short sequence."""
    scaled: list[tuple[str, dict[str, Any]]] = []
    for params in (getattr(text_config, "rope_parameters", None), getattr(text_config, "rope_scaling", None)):
        if isinstance(params, dict):
            entries = [v for v in params.values() if isinstance(v, dict)] or [params]
            scaled += [(kind, entry) for entry in entries
                       if (kind := entry.get("rope_type") or entry.get("type")) in ("longrope", "dynamic")]
    for kind, entry in scaled:
        original = (entry.get("original_max_position_embeddings")
                    or getattr(text_config, "original_max_position_embeddings", None)
                    or getattr(text_config, "max_position_embeddings", None))
        if isinstance(original, int) and original > 0:
            return original, (f"its {kind!r} RoPE switches factors past {original} positions, chosen per forward call "
                              "from the largest position in it (every row and chunk of the call), so longer contexts "
                              "would change other requests' tokens")
    no_rope = getattr(text_config, "no_rope_layers", None)
    if getattr(text_config, "attn_temperature_tuning", False) and isinstance(no_rope, (list, tuple)) and 0 in no_rope:
        floor = int(getattr(text_config, "floor_scale", 8192))
        return floor - 1, (f"its attention-temperature tuning (NoPE layers) scales by the padded batch length past "
                           f"{floor} positions, not by the row's own")
    return None


def _eos_token_ids(model: torch.nn.Module, tokenizer: HFTokenizer) -> tuple[int, ...]:
    """EOS ids from the generation config, the model config and the tokenizer, in that order."""
    found: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        values = source if isinstance(source, (list, tuple)) else [source]
        found.extend(int(v) for v in values if isinstance(v, int))
    found.extend(tokenizer.eos_token_ids)
    return tuple(dict.fromkeys(found))

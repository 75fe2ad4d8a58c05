"""Tests of gemmaserve's default model (Gemma 3 270M converted from the PyPI GGUF).

The first group checks paths, readiness validation, the lock/scratch/rename machinery (with a fake
builder, across real processes) and that importing stays light; it needs no model packages.

The second group converts the real model once per session (into ``$GEMMASERVE_CACHE_DIR`` when it
is set, so CI converts once per run, else into a temporary cache) and checks it against
transformers loading the same GGUF directly: weights, logits, greedy generation and tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gemmaserve.models
from gemmaserve.models import default_model as dm

CORE_DIR = Path(gemmaserve.models.__file__).resolve().parents[2]
HEAVY_MODULES = ("torch", "transformers", "gguf", "safetensors", "numpy")
# Tests that load the GGUF with transformers as the reference (about 3 minutes together on two
# cores, most of it transformers parsing the GGUF). The conversion-only tests stay unmarked.
slow_reference = pytest.mark.slow
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Water boils at",
)


def _run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter that can import gemmaserve; return its stdout."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CORE_DIR), full_env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# --------------------------------------------------------------------------------------------
# Paths, readiness and import lightness
# --------------------------------------------------------------------------------------------


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GEMMASERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.default_model_dir() == tmp_path / "home" / ".cache" / "gemmaserve" / "models" / "gemma-3-270m"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_model_dir() == tmp_path / "xdg" / "gemmaserve" / "models" / "gemma-3-270m"

    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "env"))
    assert dm.default_model_dir() == tmp_path / "env" / "models" / "gemma-3-270m"

    assert dm.default_model_dir(tmp_path / "explicit") == tmp_path / "explicit" / "models" / "gemma-3-270m"
    assert dm.DEFAULT_MODEL_NAME == "gemma-3-270m"


def test_import_is_light() -> None:
    out = _run_python(
        f"""
        import sys
        import gemmaserve, gemmaserve.models, gemmaserve.models.default_model
        print([m for m in {HEAVY_MODULES!r} if m in sys.modules])
        """
    )
    assert out.strip() == "[]"


def test_missing_dependency_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(dm.DefaultModelDependencyError) as info:
        dm.ensure_default_model(tmp_path, progress=False)
    assert isinstance(info.value, ImportError)
    assert 'pip install "gemmaserve[default-model]"' in str(info.value)
    assert "gguf" in str(info.value)
    assert not dm.default_model_dir(tmp_path).exists()


def _write_fake_folder(folder: Path, sha256: str | None = None) -> Path:
    """A folder with every required file (tiny) and a valid marker."""
    folder.mkdir(parents=True)
    for name in dm._REQUIRED_FILES:
        (folder / name).write_text(f"fake {name}\n")
    dm._write_marker(folder, sha256 or dm._installed_source_sha256() or "0" * 64, 0.0)
    return folder


def _corrupt_by_truncating(folder: Path) -> None:
    (folder / "model.safetensors").write_text("x")


def _corrupt_by_removing_marker(folder: Path) -> None:
    (folder / dm.MARKER_NAME).unlink()


def _corrupt_by_removing_file(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def _corrupt_by_format_version(folder: Path) -> None:
    marker = json.loads((folder / dm.MARKER_NAME).read_text())
    marker["format_version"] = dm.FORMAT_VERSION + 1
    (folder / dm.MARKER_NAME).write_text(json.dumps(marker))


def _corrupt_by_marker_garbage(folder: Path) -> None:
    (folder / dm.MARKER_NAME).write_text("{not json")


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_by_truncating,
        _corrupt_by_removing_marker,
        _corrupt_by_removing_file,
        _corrupt_by_format_version,
        _corrupt_by_marker_garbage,
    ],
)
def test_readiness_rejects_damaged_folders(tmp_path: Path, corrupt: Any) -> None:
    folder = _write_fake_folder(dm.default_model_dir(tmp_path))
    assert dm.is_default_model_ready(tmp_path)
    corrupt(folder)
    assert not dm.is_default_model_ready(tmp_path)


def test_readiness_rejects_other_source(tmp_path: Path) -> None:
    pytest.importorskip(dm._SOURCE_MODULE)
    _write_fake_folder(dm.default_model_dir(tmp_path), sha256="f" * 64)
    assert not dm.is_default_model_ready(tmp_path)


# --------------------------------------------------------------------------------------------
# Publishing: lock, scratch directory, atomic rename (fake builder)
# --------------------------------------------------------------------------------------------


def test_racing_processes_build_once(tmp_path: Path) -> None:
    target = dm.default_model_dir(tmp_path)
    builds = tmp_path / "builds.log"
    script = f"""
        import time
        from pathlib import Path
        from gemmaserve.models import default_model as dm

        def build(scratch: Path) -> Path:
            with open({str(builds)!r}, "a") as log:
                log.write("build\\n")
            folder = scratch / "model"
            folder.mkdir()
            for name in dm._REQUIRED_FILES:
                (folder / name).write_text(name)
                time.sleep(0.1)  # keep the build open so the others must wait
            dm._write_marker(folder, dm._installed_source_sha256() or "0" * 64, 0.0)
            return folder

        print(dm._publish_once(Path({str(target)!r}), build))
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(CORE_DIR), os.environ.get("PYTHONPATH")])))
    racers = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [racer.communicate(timeout=120)[0].strip() for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0, 0]
    assert outputs == [str(target)] * 3
    assert builds.read_text().splitlines() == ["build"]
    assert dm.is_default_model_ready(tmp_path)
    assert sorted(p.name for p in target.parent.iterdir()) == [".gemma-3-270m.lock", "gemma-3-270m"]


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    target = dm.default_model_dir(tmp_path)

    def build(scratch: Path) -> Path:
        (scratch / "model").mkdir()
        (scratch / "model" / "config.json").write_text("{}")
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError, match="conversion crashed"):
        dm._publish_once(target, build)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".gemma-3-270m.lock"]


def test_invalid_folder_and_leftovers_are_replaced(tmp_path: Path) -> None:
    target = dm.default_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("half-written")
    (target.parent / ".gemma-3-270m.tmp-crashed").mkdir()
    (target.parent / ".gemma-3-270m.stale-crashed").mkdir()

    assert dm._publish_once(target, lambda scratch: _write_fake_folder(scratch / "model")) == target
    assert (target / "config.json").read_text() == "fake config.json\n"
    assert sorted(p.name for p in target.parent.iterdir()) == [".gemma-3-270m.lock", "gemma-3-270m"]


def test_valid_folder_is_not_rebuilt(tmp_path: Path) -> None:
    target = _write_fake_folder(dm.default_model_dir(tmp_path))

    def build(scratch: Path) -> Path:
        raise AssertionError("must not rebuild a valid folder")

    assert dm._publish_once(target, build) == target
    assert dm.ensure_default_model(tmp_path) == target


# --------------------------------------------------------------------------------------------
# The real model (one conversion per session)
# --------------------------------------------------------------------------------------------


def _require_model_packages() -> None:
    for module in ("numpy", "torch", "safetensors", "gguf", "transformers", "accelerate", dm._SOURCE_MODULE):
        pytest.importorskip(module)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted folder: in $GEMMASERVE_CACHE_DIR if set (CI), else a session temp cache."""
    _require_model_packages()
    cache = None if os.environ.get("GEMMASERVE_CACHE_DIR") else tmp_path_factory.mktemp("gemmaserve-cache")
    started = time.perf_counter()
    folder = dm.ensure_default_model(cache, progress=True)
    print(f"\nensure_default_model (cold or CI-cached): {time.perf_counter() - started:.1f} s -> {folder}")
    return folder


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The assembled GGUF, for transformers' own loader."""
    _require_model_packages()
    import importlib

    source = importlib.import_module(dm._SOURCE_MODULE)
    return Path(source.assemble(tmp_path_factory.mktemp("gguf") / source.MODEL_NAME))


@pytest.fixture(scope="session")
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="session")
def reference_f32(gguf_file: Path, offline: None) -> Any:
    """transformers' Gemma3ForCausalLM loaded straight from the GGUF, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference_bf16(gguf_file: Path, offline: None) -> Any:
    """The same, loaded with ``dtype=torch.bfloat16``. (Casting the float32 model with ``.to()``
    is not equivalent: it also casts the rotary ``inv_freq`` buffers, which a bf16 load keeps in
    float32.)"""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="session")
def reference_tokenizer(gguf_file: Path, offline: None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="session")
def converted_f32(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="session")
def converted_bf16(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="session")
def converted_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _logits(model: Any, tokenizer: Any, prompt: str) -> Any:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0].float()


def _greedy(model: Any, tokenizer: Any, prompt: str, new_tokens: int = 20) -> list[int]:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def _safetensors_dtypes(path: Path) -> set[str]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def test_folder_layout(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()} - {dm.VERIFIED_NAME}  # the content check's record
    assert set(dm._REQUIRED_FILES) | {"README.md", "README.upstream.md", dm.MARKER_NAME} == names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert _safetensors_dtypes(model_dir / "model.safetensors") == {"BF16"}
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "GemmaTokenizer"
    assert "is_local" not in tokenizer_config and "local_files_only" not in tokenizer_config
    marker = json.loads((model_dir / dm.MARKER_NAME).read_text())
    assert marker["source_sha256"] == dm._installed_source_sha256()
    assert marker["dtype"] == "bfloat16"


def test_licence_files_are_the_packages(model_dir: Path) -> None:
    from importlib.resources import files

    data = files(dm._SOURCE_MODULE).joinpath("data")
    for name in ("NOTICE.md", "GEMMA_TERMS.html", "README.upstream.md"):
        assert (model_dir / name).read_bytes() == data.joinpath(name).read_bytes()
    assert "Gemma Terms of Use" in (model_dir / "README.md").read_text()


def test_warm_call_is_fast_and_light(model_dir: Path) -> None:
    out = _run_python(
        f"""
        import json, sys, time
        started = time.perf_counter()
        from gemmaserve.models import ensure_default_model, is_default_model_ready
        imported = time.perf_counter()
        path = ensure_default_model({str(model_dir.parents[1])!r})
        called = time.perf_counter()
        print(json.dumps({{
            "path": str(path), "import_s": imported - started, "call_s": called - imported,
            "ready": is_default_model_ready({str(model_dir.parents[1])!r}),
            "heavy": [m for m in {HEAVY_MODULES!r} if m in sys.modules],
        }}))
        """
    )
    result = json.loads(out)
    print(f"\nwarm: import {result['import_s'] * 1000:.1f} ms, ensure_default_model {result['call_s'] * 1000:.1f} ms")
    assert result["path"] == str(model_dir)
    assert result["ready"] is True
    assert result["heavy"] == []
    assert result["call_s"] < 0.5


@slow_reference
def test_config_matches_gguf_config(model_dir: Path, reference_f32: Any) -> None:
    from transformers import AutoConfig

    ours, theirs = AutoConfig.from_pretrained(model_dir), reference_f32.config
    for key in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
        "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation",
        "tie_word_embeddings", "use_bidirectional_attention", "bos_token_id", "eos_token_id", "pad_token_id",
    ):  # fmt: skip
        assert getattr(ours, key) == getattr(theirs, key), key
    import numpy as np

    assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)


@slow_reference
def test_weights_equal_gguf_weights_in_bf16(converted_bf16: Any, reference_bf16: Any) -> None:
    import torch

    ours = dict(converted_bf16.named_parameters())
    theirs = dict(reference_bf16.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype == torch.bfloat16, name
        assert torch.equal(value, theirs[name]), name


@slow_reference
def test_logits_bf16_identical_to_gguf(converted_bf16: Any, reference_bf16: Any, converted_tokenizer: Any) -> None:
    import torch

    for prompt in PROMPTS:
        ours = _logits(converted_bf16, converted_tokenizer, prompt)
        theirs = _logits(reference_bf16, converted_tokenizer, prompt)
        assert torch.equal(ours, theirs), prompt


@slow_reference
def test_logits_f32_close_to_gguf(converted_f32: Any, reference_f32: Any, converted_tokenizer: Any) -> None:
    """float32 compute on bf16-rounded weights vs the exact dequantized weights: a small drift
    (measured max 0.18 on logits spanning about +-30) and the same argmax everywhere."""
    for prompt in PROMPTS:
        ours = _logits(converted_f32, converted_tokenizer, prompt)
        theirs = _logits(reference_f32, converted_tokenizer, prompt)
        assert (ours - theirs).abs().max().item() < 0.5, prompt
        assert (ours.argmax(-1) == theirs.argmax(-1)).all(), prompt


@slow_reference
def test_greedy_generation_matches_gguf(
    converted_f32: Any, reference_f32: Any, converted_bf16: Any, reference_bf16: Any, converted_tokenizer: Any
) -> None:
    prompt = "The capital of France is"
    ours = _greedy(converted_f32, converted_tokenizer, prompt)
    assert ours == _greedy(reference_f32, converted_tokenizer, prompt)
    assert _greedy(converted_bf16, converted_tokenizer, prompt) == _greedy(reference_bf16, converted_tokenizer, prompt)

    text = converted_tokenizer.decode(ours, skip_special_tokens=True)
    print(f"\ngreedy f32: {prompt!r} -> {text!r}")
    assert len(ours) == 20
    assert "France" in text or "Paris" in text
    assert re.fullmatch(r"[A-Za-z0-9 ,.;:'\"()\-\n]+", text), text
    assert len(re.findall(r"\b(the|of|is|a|and|in|city|capital)\b", text)) >= 4, text


TOKENIZER_SAMPLES = (
    "The capital of France is",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "héllo wörld — 你好, мир! 🤖",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x ** 2  # square",
    "<bos>already has a bos",
    "",
)


@slow_reference
def test_tokenizer_matches_gguf_tokenizer(converted_tokenizer: Any, reference_tokenizer: Any) -> None:
    ours, theirs = converted_tokenizer, reference_tokenizer
    assert type(ours).__name__ == type(theirs).__name__ == "GemmaTokenizer"
    assert len(ours) == len(theirs) == 262144
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (2, 1, 0, 3)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id) == (2, 1, 0, 3)
    assert ours.all_special_tokens == theirs.all_special_tokens
    for text in TOKENIZER_SAMPLES:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special).input_ids
            assert ids == theirs(text, add_special_tokens=special).input_ids, (text, special)
            assert ours.decode(ids) == theirs.decode(ids), text
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text


@slow_reference
def test_tokenizer_adds_bos_like_gguf(converted_tokenizer: Any, reference_tokenizer: Any) -> None:
    """BOS insertion behaves the same. (The ``add_bos_token`` attribute itself differs: transformers
    5 keeps BOS insertion in tokenizer.json's post-processor and reports False after a reload.)"""
    for tokenizer in (converted_tokenizer, reference_tokenizer):
        assert tokenizer("hello").input_ids[0] == 2
        assert tokenizer("hello").input_ids.count(2) == 1
        assert 2 not in tokenizer("hello", add_special_tokens=False).input_ids
        assert 1 not in tokenizer("hello").input_ids  # no EOS appended


def test_a_same_size_corruption_is_caught_by_content_and_files_are_hashed_once(tmp_path: Path, monkeypatch) -> None:
    """The cheap readiness check stats sizes only; the start-up check (``content=True``) compares SHA-256s with
    the marker, so a same-size corruption is a problem (ensure_default_model then rebuilds). A file unchanged
    since its last verification is not re-hashed."""
    folder = _write_fake_folder(dm.default_model_dir(tmp_path))
    assert dm._folder_problem(folder, content=True) is None
    assert (folder / dm.VERIFIED_NAME).is_file()
    hashed: list[str] = []
    original = dm._sha256
    monkeypatch.setattr(dm, "_sha256", lambda path: hashed.append(path.name) or original(path))
    assert dm._folder_problem(folder, content=True) is None and hashed == []  # verified before: no hashing
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # same size, other content
    assert dm.is_default_model_ready(tmp_path), "the cheap check cannot see it"
    problem = dm._folder_problem(folder, content=True)
    assert problem is not None and "model.safetensors" in problem and "SHA-256" in problem
    assert hashed == ["model.safetensors"]


def test_folders_without_recorded_hashes_are_verified_from_first_sight(tmp_path: Path) -> None:
    folder = _write_fake_folder(dm.default_model_dir(tmp_path))
    marker = json.loads((folder / dm.MARKER_NAME).read_text())
    del marker["sha256"]  # a folder converted before hashes were recorded
    (folder / dm.MARKER_NAME).write_text(json.dumps(marker))
    assert dm._folder_problem(folder, content=True) is None  # first sight: the baseline
    weights = folder / "tokenizer.json" if (folder / "tokenizer.json").exists() else folder / "model.safetensors"
    data = weights.read_bytes()
    time.sleep(0.01)
    weights.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    assert "SHA-256" in (dm._folder_problem(folder, content=True) or "")

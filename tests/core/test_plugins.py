"""Plugin discovery, the registry, availability reasons and backend selection."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import pytest

from gemmaserve import BackendSpec, hookimpl
from gemmaserve.errors import BackendUnavailableError, ConfigurationError
from gemmaserve.plugins import load_registry, register_plugin, unregister_plugin
from gemmaserve.registry import BackendRegistry
from gemmaserve.selection import backend_statuses, select_backend
from gemmaserve.settings import load_settings


def unavailable_probe(settings: object, device: str) -> str | None:
    return "needs a unicorn"


def available_probe(settings: object, device: str) -> str | None:
    return None


PROBE_MODULE = __name__


def test_registry_lists_registered_and_known_backends(fake_plugins) -> None:
    fake_plugins(
        "fake_a",
        BackendSpec("fast-cpu", f"{PROBE_MODULE}:available_probe", ("cpu",), f"{PROBE_MODULE}:available_probe",
                    priority=5, aliases=("fast",)),
        BackendSpec("broken", "x.y:z", ("cpu",), f"{PROBE_MODULE}:unavailable_probe", priority=1),
        BackendSpec("no-factory", "x.y:z", ("cpu",), f"{PROBE_MODULE}:available_probe", priority=7),
    )
    settings = load_settings(device="cpu", backend="auto")
    registry = load_registry()
    assert registry.resolve_name("FAST") == "fast-cpu"
    rows = {row.name: row for row in backend_statuses(settings, registry)}
    assert rows["fast-cpu"].available and rows["fast-cpu"].plugin == "fake_a"
    assert not rows["broken"].available and rows["broken"].reason == "needs a unicorn"
    # its probe passes but its factory does not import: not available (selection would pass over it)
    assert not rows["no-factory"].available and "cannot be imported" in (rows["no-factory"].reason or "")
    for known in ("hf", "custom-cuda", "mlx"):
        assert known in rows
        if rows[known].spec is None:  # plugin not installed: the exact pip command is the reason
            assert "pip install" in (rows[known].reason or "")


def test_auto_selection_skips_unavailable_and_records_why(fake_plugins) -> None:
    fake_plugins(
        "fake_b",
        BackendSpec("alpha", "x.y:z", ("cpu",), f"{PROBE_MODULE}:unavailable_probe", priority=-100),
        BackendSpec("beta", f"{PROBE_MODULE}:available_probe", ("cpu",), f"{PROBE_MODULE}:available_probe",
                    priority=-99),  # auto checks that the factory imports: any importable attribute will do
        BackendSpec("gamma", "x.y:z", ("cuda",), None, priority=-200),
    )
    selection = select_backend(load_settings(device="cpu", backend="auto"))
    assert selection.spec.name == "beta"
    assert selection.rejected["alpha"] == "needs a unicorn"
    assert "does not run on cpu" in selection.rejected["gamma"]


def test_explicit_backend_wins_and_errors_are_clear(fake_plugins) -> None:
    fake_plugins(
        "fake_c",
        BackendSpec("delta", "x.y:z", ("cpu",), f"{PROBE_MODULE}:available_probe", priority=900),
        BackendSpec("epsilon", "x.y:z", ("cpu",), f"{PROBE_MODULE}:unavailable_probe", priority=900),
    )
    assert select_backend(load_settings(backend="delta", device="cpu")).spec.name == "delta"
    with pytest.raises(BackendUnavailableError, match="needs a unicorn"):
        select_backend(load_settings(backend="epsilon", device="cpu"))
    with pytest.raises(ConfigurationError, match="accepted: auto, .*delta"):
        select_backend(load_settings(backend="no-such-backend"))


def test_an_unknown_backend_suggests_the_family_member_for_the_device() -> None:
    """``custom`` names a family: the member for DEVICE is suggested (not whichever spelling is closest), all of
    them when the device names none; a plain misspelling gets the closest name."""
    with pytest.raises(ConfigurationError, match=r"BACKEND='custom' \(did you mean 'custom-cpu'\?\)"):
        select_backend(load_settings(backend="custom", device="cpu"))
    with pytest.raises(ConfigurationError,
                       match=r"\(did you mean 'custom-cpu' or 'custom-cuda' or 'custom-mps'\?\)"):
        select_backend(load_settings(backend="custom", device="auto"))
    with pytest.raises(ConfigurationError, match=r"BACKEND='hff' \(did you mean 'hf'\?\)"):
        select_backend(load_settings(backend="hff", device="cpu"))


def test_name_clash_between_plugins_is_reported(fake_plugins) -> None:
    fake_plugins("fake_d", BackendSpec("zeta", "x.y:z", ("cpu",)))
    fake_plugins("fake_e", BackendSpec("zeta", "x.y:z", ("cpu",)))
    registry = load_registry()
    assert "already registered" in registry.plugin_errors["fake_e"]
    registry.check_integrity()


def test_broken_plugin_hook_does_not_break_others(fake_plugins) -> None:
    class Broken:
        @hookimpl
        def gemmaserve_register_backends(self, register: Callable[[BackendSpec], None]) -> None:
            raise RuntimeError("boom")

    register_plugin(Broken(), "fake_broken")
    try:
        fake_plugins("fake_f", BackendSpec("eta", "x.y:z", ("cpu",)))
        registry = load_registry()
        assert "boom" in registry.plugin_errors["fake_broken"]
        assert registry.get("eta") is not None
    finally:
        unregister_plugin("fake_broken")


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="module:attribute"):
        BackendSpec("x", "no_colon", ("cpu",))
    with pytest.raises(ValueError, match="lower-case"):
        BackendSpec("X", "a:b", ("cpu",))
    with pytest.raises(ValueError, match="'my-gpu'"):  # BACKEND=my_gpu would be normalised to my-gpu
        BackendSpec("my_gpu", "a:b", ("cpu",))
    with pytest.raises(ValueError, match="'fast-one'"):
        BackendSpec("ok", "a:b", ("cpu",), aliases=("fast_one",))
    registry = BackendRegistry()
    registry.add(BackendSpec("a", "m:f", ("cpu",), aliases=("b",)), "p")
    registry.check_integrity()


def test_import_gemmaserve_is_light() -> None:
    import subprocess

    code = (
        "import sys, gemmaserve, gemmaserve.cli, gemmaserve.api, gemmaserve.selection, gemmaserve.plugins;"
        "from gemmaserve import LLM, SamplingParams;"
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'mlx') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plugin_module_is_a_module_of_hookimpls() -> None:
    module = types.ModuleType("inline_plugin")

    @hookimpl
    def gemmaserve_register_backends(register: Callable[[BackendSpec], None]) -> None:
        register(BackendSpec("theta", "m:f", ("cpu",)))

    module.gemmaserve_register_backends = gemmaserve_register_backends  # type: ignore[attr-defined]
    register_plugin(module, "inline_plugin")
    try:
        assert load_registry().get("theta") is not None
    finally:
        unregister_plugin("inline_plugin")


def test_a_backend_that_skipped_super_init_still_serves(monkeypatch) -> None:
    """A third-party backend whose __init__ forgets super().__init__() gets its lock on first use instead of
    killing the engine thread (LLM.generate used to hang forever)."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.backend import InferenceBackend
    from gemmaserve.engine import Engine
    from gemmaserve.settings import CoreSettings
    from gemmaserve.testing import ReferenceBackend

    monkeypatch.setattr(InferenceBackend, "__init__", lambda self: None)  # what a forgotten super() leaves
    backend = ReferenceBackend()
    monkeypatch.undo()
    assert "_backend_lock" not in backend.__dict__
    assert backend.lock is backend.lock and backend.last_cache_hit_tokens == 0
    settings = CoreSettings(max_batch_size=4)
    with LLM(settings=settings, engine=Engine(backend, settings, owns_backend=True)) as llm:
        out = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_first_party_names_are_reserved(fake_plugins) -> None:
    """A third-party plugin that registers 'hf' fails (reported against it); the real hf plugin keeps the
    name whatever the loading order."""
    fake_plugins("aaa_impostor", BackendSpec("hf", "x.y:z", ("cpu",)), BackendSpec("own-name", "x.y:z", ("cpu",)))
    registry = load_registry()
    assert "reserved for the first-party distribution 'gemmaserve-hf-torch'" in registry.plugin_errors["aaa_impostor"]
    hf = registry.get("hf")
    assert hf is None or hf.plugin.replace("_", "-") == "gemmaserve-hf-torch"
    reg = BackendRegistry()
    reg.add(BackendSpec("hf", "m:f", ("cpu",)), "gemmaserve_hf_torch")  # the real distribution (any spelling)
    with pytest.raises(ConfigurationError, match="reserved"):
        BackendRegistry().add(BackendSpec("mine", "m:f", ("cpu",), aliases=("custom-cpu",)), "other-dist")


class _Chooser:
    def __init__(self, name: str) -> None:
        self.name = name

    @hookimpl
    def gemmaserve_select_backend(self, settings, candidates, device):  # type: ignore[no-untyped-def]
        return self.name


def test_a_plugins_choice_gets_the_device_and_probe_checks(fake_plugins) -> None:
    fake_plugins("fake_choice", BackendSpec("unicorn-only", "x.y:z", ("cpu",), f"{PROBE_MODULE}:unavailable_probe"),
                 BackendSpec("fine", "x.y:z", ("cpu",), f"{PROBE_MODULE}:available_probe"))
    settings = load_settings(backend="auto", device="cpu")
    for choice, expected in (("unicorn-only", "needs a unicorn"), ("fine", None)):
        register_plugin(_Chooser(choice), "fake_chooser")
        try:
            if expected is None:
                assert select_backend(settings).spec.name == "fine"
            else:
                with pytest.raises(BackendUnavailableError, match=f"hook chose backend 'unicorn-only'.*{expected}"):
                    select_backend(settings)
        finally:
            unregister_plugin("fake_chooser")


def config_error_probe(settings: object, device: str) -> str | None:
    raise ConfigurationError("settings: FAKE_TRUST=maybe is not a boolean")


def test_invalid_plugin_settings_stop_auto_selection(fake_plugins) -> None:
    """BACKEND=auto must not fall through past a plugin whose settings are invalid (they stop startup); the
    listing shows the problem instead of raising."""
    fake_plugins("fake_strict", BackendSpec("strict-one", "x.y:z", ("cpu",), f"{PROBE_MODULE}:config_error_probe",
                                            priority=-50),
                 BackendSpec("fallback", "x.y:z", ("cpu",), f"{PROBE_MODULE}:available_probe", priority=-40))
    settings = load_settings(backend="auto", device="cpu")
    with pytest.raises(ConfigurationError, match="FAKE_TRUST=maybe"):
        select_backend(settings)
    rows = {row.name: row for row in backend_statuses(settings)}
    assert not rows["strict-one"].available and "FAKE_TRUST=maybe" in (rows["strict-one"].reason or "")

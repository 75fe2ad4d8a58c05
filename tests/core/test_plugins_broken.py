"""Broken third-party plugins (misspelt hooks, sys.exit at import, stolen first-party aliases, factories that do
not import) are recorded in ``plugin_errors`` or skipped; the other plugins and the built-in backends keep
working."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pluggy
import pytest
from gemmaserve import BackendSpec, hookimpl, plugins
from gemmaserve.errors import BackendUnavailableError, ConfigurationError
from gemmaserve.hardware import detect_devices
from gemmaserve.plugins import get_plugin_manager, load_registry, register_plugin, reset_plugins
from gemmaserve.registry import KNOWN_BACKENDS, BackendRegistry
from gemmaserve.selection import select_backend
from gemmaserve.settings import load_settings

MODULES = {
    "gs_typo_mod": """
        from gemmaserve import hookimpl
        @hookimpl
        def gemmaserve_register_backend(register):  # misspelt: the hookspec is gemmaserve_register_backends
            pass
        """,
    "gs_sysexit_mod": "import sys; sys.exit('plugin refuses')\n",
    "gs_good_mod": """
        from gemmaserve import BackendSpec, hookimpl
        @hookimpl
        def gemmaserve_register_backends(register):
            register(BackendSpec("still-here", "gs_good_mod:factory", ("cpu",), priority=1000))
        def factory(model, device, settings):
            raise NotImplementedError
        """,
}


def fake_factory(model_path: str, device: str, settings: object) -> object:
    raise NotImplementedError


def available_probe(settings: object, device: str) -> str | None:
    return None


FACTORY = f"{__name__}:fake_factory"
PROBE = f"{__name__}:available_probe"


@pytest.fixture
def entry_point_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``add(name=module, ...)``: entry points of the ``gemmaserve.backends`` group added to the installed ones
    (modules from MODULES, written to a scratch directory); the plugins reload with them."""
    for module, source in MODULES.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    real = plugins.entry_points

    def add(**named: str) -> None:
        fakes = [EntryPoint(name, module, plugins.ENTRY_POINT_GROUP) for name, module in named.items()]
        monkeypatch.setattr(plugins, "entry_points", lambda group: [*real(group=group), *fakes])
        reset_plugins()

    yield add
    monkeypatch.setattr(plugins, "entry_points", real)
    reset_plugins()
    for module in MODULES:
        sys.modules.pop(module, None)


def test_a_misspelt_hook_is_recorded_and_the_other_plugins_load(entry_point_plugins) -> None:
    entry_point_plugins(typo="gs_typo_mod", good="gs_good_mod")
    registry = load_registry()  # used to raise PluginValidationError for every command
    assert "unknown hook 'gemmaserve_register_backend'" in registry.plugin_errors["typo"]
    assert get_plugin_manager().get_plugin("typo") is None
    assert registry.get("still-here") is not None


def test_sys_exit_in_a_plugin_is_recorded_and_the_other_plugins_load(entry_point_plugins) -> None:
    entry_point_plugins(aaa_exit="gs_sysexit_mod", good="gs_good_mod")
    registry = load_registry()  # SystemExit used to end the process
    assert registry.plugin_errors["aaa_exit"] == "SystemExit: plugin refuses"
    assert registry.get("still-here") is not None


def test_register_plugin_refuses_an_unknown_hook_and_registers_nothing() -> None:
    class Typo:
        @hookimpl
        def gemmaserve_register_backend(self, register: Callable[[BackendSpec], None]) -> None:
            pass

    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'gemmaserve_register_backend'"):
        register_plugin(Typo(), "fake_typo")
    assert get_plugin_manager().get_plugin("fake_typo") is None
    get_plugin_manager().check_pending()  # nothing of it left behind


def test_a_first_party_alias_is_reserved(fake_plugins) -> None:
    """'aaa' sorts before 'hf_torch': claiming hf's alias 'torch' used to make hf itself fail to register."""
    fake_plugins("aaa_hijack", BackendSpec("mine", FACTORY, ("cpu",), aliases=("torch",), priority=999))
    registry = load_registry()
    assert "'torch' (an alias of the first-party backend 'hf')" in registry.plugin_errors["aaa_hijack"]
    assert registry.get("mine") is None
    with pytest.raises(ConfigurationError, match="reserved for the first-party distribution 'gemmaserve-hf-torch'"):
        BackendRegistry().add(BackendSpec("mine", "m:f", ("cpu",), aliases=("hf-torch",)), "other-dist")
    hf = registry.get("torch")
    if hf is not None:  # the hf plugin is installed: it kept its name and aliases
        assert hf.name == "hf" and "hf" not in registry.plugin_errors and "hf_torch" not in registry.plugin_errors


def test_first_party_specs_declare_no_alias_the_core_does_not_reserve() -> None:
    from gemmaserve.registry import known_backend

    for spec in load_registry().specs.values():
        known = known_backend(spec.name)
        if known is not None:
            assert set(spec.aliases) <= set(known.aliases), (spec.name, spec.aliases)
    assert known_backend("TORCH") is KNOWN_BACKENDS[0]


def test_auto_skips_a_backend_whose_factory_does_not_import(fake_plugins) -> None:
    fake_plugins("fake_factories",
                 BackendSpec("badfactory", "no_such_module_abc:create", ("cpu",), PROBE, priority=-1000),
                 BackendSpec("nofunc", f"{__name__}:no_such_function", ("cpu",), PROBE, priority=-999),
                 BackendSpec("goodfactory", FACTORY, ("cpu",), PROBE, priority=-998))
    selection = select_backend(load_settings(backend="auto", device="cpu"))
    assert selection.spec.name == "goodfactory"
    assert "'no_such_module_abc:create' cannot be imported: ModuleNotFoundError" in selection.rejected["badfactory"]
    assert "has no attribute 'no_such_function'" in selection.rejected["nofunc"]


def test_an_unknown_backend_names_the_plugins_that_failed_to_load() -> None:
    registry = BackendRegistry(plugin_errors={"sysexit": "SystemExit: plugin refuses"})
    with pytest.raises(ConfigurationError, match=r"unknown BACKEND='sysexit'.*'sysexit' \(SystemExit: plugin refuses\)"):
        select_backend(load_settings(backend="sysexit"), registry)
    with pytest.raises(BackendUnavailableError, match=r"plugin not installed.*'sysexit' \(SystemExit"):
        select_backend(load_settings(backend="torch"), registry)  # an alias of a known backend gets its install hint


def _dist(site: Path, name: str, module: str, source: str) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[gemmaserve.backends]\n{name} = {module}\n")


def test_backends_command_survives_broken_plugins(tmp_path: Path) -> None:
    """End to end through real entry points: every command used to die (a traceback, or sys.exit's status)."""
    _dist(tmp_path, "typo", "gs_typo_mod", MODULES["gs_typo_mod"])
    _dist(tmp_path, "sysexit", "gs_sysexit_mod", MODULES["gs_sysexit_mod"])
    _dist(tmp_path, "aaa_hijack", "gs_hijack_mod", """
        from gemmaserve import BackendSpec, hookimpl
        @hookimpl
        def gemmaserve_register_backends(register):
            register(BackendSpec("mine", "gs_hijack_mod:f", ("cpu",), aliases=("torch",), priority=999))
        """)
    _dist(tmp_path, "badfactory", "gs_badfactory_mod", """
        from gemmaserve import BackendSpec, hookimpl
        @hookimpl
        def gemmaserve_register_backends(register):
            register(BackendSpec("badfactory", "no_such_module_abc:create", ("cpu",), priority=1))
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "BACKEND": "auto",
           "DEVICE": "cpu", "LOG_LEVEL": "error"}
    result = subprocess.run([sys.executable, "-m", "gemmaserve", "backends"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120)
    out = result.stdout + result.stderr
    assert "Traceback" not in out
    assert "plugin 'typo' failed to load: PluginValidationError: unknown hook" in out
    assert "plugin 'sysexit' failed to load: SystemExit: plugin refuses" in out
    assert "plugin 'aaa_hijack' failed to load: ConfigurationError: backend name 'torch'" in out
    assert "rejected badfactory: its factory 'no_such_module_abc:create' cannot be imported" in out
    assert "selected: badfactory" not in out
    assert result.returncode == 0 and "selected: " in result.stdout, out


@pytest.mark.skipif("cuda" in detect_devices().available, reason="needs a machine without CUDA")
def test_backends_exits_nonzero_when_nothing_can_run_on_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    from gemmaserve.cli import main

    assert main(["backends", "--device", "cuda"]) == 2  # used to print "selection: none" and exit 0
    assert "selection: none (no backend can run on cuda" in capsys.readouterr().out


@pytest.mark.parametrize("devices, probe", [("cpu,cuda", None), (("gpu",), None), ((), None), (("cpu",), "pkg.mod")])
def test_a_spec_with_bad_devices_or_probe_is_refused_naming_it(devices, probe) -> None:
    """A string of devices was split into characters (listed as 'c,p,u,...' and shown available on cpu); a device
    kind that does not exist was 'unavailable: not detected'; a probe path without ':' failed at selection."""
    with pytest.raises(ValueError, match="devices must be|'module:attribute'"):
        BackendSpec("mine", "m:f", devices, probe)

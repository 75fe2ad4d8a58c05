"""Backend selection: ``BACKEND`` wins; otherwise a rule over (device, available backends).

The decision and every rejected alternative (with its reason) are logged and returned, so
``gemmaserve backends`` can show them.
"""

from __future__ import annotations

import difflib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from gemmaserve.errors import BackendUnavailableError, ConfigurationError
from gemmaserve.hardware import detect_devices
from gemmaserve.plugins import get_plugin_manager, load_registry
from gemmaserve.registry import (
    KNOWN_BACKENDS,
    BackendRegistry,
    BackendSpec,
    BackendStatus,
    known_backend,
    resolve_dotted,
)
from gemmaserve.settings import CoreSettings

__all__ = ["Selection", "backend_statuses", "factory_problem", "probe_backend", "capability_problem",
           "select_backend"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen backend and device, and why the others were not chosen."""

    spec: BackendSpec
    device: str
    reason: str
    rejected: dict[str, str] = field(default_factory=dict)


def capability_problem(spec: BackendSpec, settings: CoreSettings, registry: BackendRegistry) -> str | None:
    """Why ``spec`` cannot honour the settings that need a declared capability (``BackendSpec.quantization``,
    ``tensor_parallel``, ``expert_parallel``): ``QUANTIZATION``, ``TENSOR_PARALLEL_SIZE`` > 1,
    ``ENABLE_EXPERT_PARALLEL``; names the backends of ``registry`` that can. None when it can."""
    wanted = settings.quantization
    if wanted is not None and wanted not in spec.quantization:
        runners = sorted(other.name for other in registry.specs.values() if wanted in other.quantization)
        alternative = f"use {' / '.join(runners)} (BACKEND), which run it" if runners else "no installed backend runs it"
        return (f"QUANTIZATION={wanted}: backend {spec.name!r} does not support it (it supports "
                f"{', '.join(spec.quantization) or 'none'}); unset QUANTIZATION, or {alternative}")
    if settings.tensor_parallel_size > 1 and not spec.tensor_parallel:
        runners = sorted(other.name for other in registry.specs.values() if other.tensor_parallel)
        return (f"TENSOR_PARALLEL_SIZE={settings.tensor_parallel_size}: backend {spec.name!r} does not support tensor "
                f"parallel; set TENSOR_PARALLEL_SIZE=1, or use {' / '.join(runners) or 'a backend that does'} "
                "(BACKEND), which split the model over torch.distributed ranks")
    if settings.enable_expert_parallel and not spec.expert_parallel:
        runners = sorted(other.name for other in registry.specs.values() if other.expert_parallel)
        return (f"ENABLE_EXPERT_PARALLEL: backend {spec.name!r} does not support expert parallel; unset it, or use "
                f"{' / '.join(runners) or 'a backend that does'} (BACKEND), which split MoE experts over "
                "torch.distributed ranks")
    return None


def probe_backend(spec: BackendSpec, settings: CoreSettings, device: str, *, strict: bool = False,
                  registry: BackendRegistry | None = None) -> str | None:
    """Why ``spec`` cannot run on ``device`` with these settings, or None if it can. ``strict`` (choosing the
    backend to start): an invalid setting of the plugin (``ConfigurationError`` from its probe) is raised, since
    invalid values stop startup, instead of counting as "unavailable" and letting another backend be chosen.
    ``registry`` (default: the installed one) names the backends that have a capability this one lacks
    (:func:`capability_problem`)."""
    if device not in spec.devices:
        return f"does not run on {device} (runs on: {', '.join(spec.devices)})"
    problem = capability_problem(spec, settings, registry if registry is not None else load_registry())
    if problem is not None:
        return problem
    report = detect_devices()
    if device not in report.available:
        return f"device {device} unavailable: {report.unavailable.get(device, 'not detected')}"
    if spec.probe is None:
        return None
    try:
        return resolve_dotted(spec.probe)(settings, device)
    except ConfigurationError:
        if strict:
            raise
        return f"invalid settings: {sys.exc_info()[1]}"
    except Exception as exc:  # a broken probe means "unavailable", with the error as the reason
        return f"availability probe failed: {type(exc).__name__}: {exc}"


def factory_problem(spec: BackendSpec) -> str | None:
    """Why ``spec``'s factory cannot be imported (what ``build_engine`` would fail on), or None if it imports."""
    try:
        resolve_dotted(spec.factory)
    except (Exception, SystemExit) as exc:  # any import-time failure, even sys.exit in the module
        return f"its factory {spec.factory!r} cannot be imported: {type(exc).__name__}: {exc}"
    return None


def _device_for(spec: BackendSpec, settings: CoreSettings) -> str:
    if settings.device != "auto":
        return settings.device
    report = detect_devices()
    for device in report.available:
        if device in spec.devices:
            return device
    return spec.devices[0]


def backend_statuses(settings: CoreSettings, registry: BackendRegistry | None = None) -> list[BackendStatus]:
    """One row per backend (installed or known): availability on the device it would use (its probe passes and
    its factory imports, as selection requires)."""
    registry = registry or load_registry()
    rows: list[BackendStatus] = []
    for spec in sorted(registry.specs.values(), key=lambda s: (s.priority, s.name)):
        reason = probe_backend(spec, settings, _device_for(spec, settings), registry=registry)
        if reason is None:
            reason = factory_problem(spec)
        rows.append(BackendStatus(spec.name, spec.plugin, spec.devices, reason is None, reason, spec))
    for known in KNOWN_BACKENDS:
        if known.name not in registry.specs:
            rows.append(BackendStatus(known.name, known.distribution, known.devices, False, known.install_hint))
    return rows


def select_backend(settings: CoreSettings, registry: BackendRegistry | None = None) -> Selection:
    """Pick the backend and device. ``BACKEND=auto`` takes the first candidate (by priority) that passes its probe
    and whose factory imports, recording why each one before it was skipped. Raises ConfigurationError (unknown
    name) or BackendUnavailableError (nothing can run), each listing the alternatives and reasons."""
    registry = registry or load_registry()
    if settings.backend != "auto":
        return _select_explicit(settings, registry)
    device = settings.device if settings.device != "auto" else detect_devices().best
    candidates = sorted(
        (spec for spec in registry.specs.values() if device in spec.devices), key=lambda s: (s.priority, s.name)
    )
    rejected = {
        spec.name: f"does not run on {device}" for spec in registry.specs.values() if device not in spec.devices
    }
    hooked = get_plugin_manager().hook.gemmaserve_select_backend(settings=settings, candidates=candidates, device=device)
    if hooked is not None:
        spec = registry.get(hooked)
        if spec is None:
            raise ConfigurationError(f"a plugin selected unknown backend {hooked!r}")
        reason = probe_backend(spec, settings, device, strict=True, registry=registry)
        if reason is not None:  # a plugin's choice gets the same device and probe checks as any other
            raise BackendUnavailableError(
                f"a plugin's gemmaserve_select_backend hook chose backend {spec.name!r}, which cannot run on "
                f"{device}: {reason}"
            )
        selection = Selection(spec, device, "chosen by a plugin's gemmaserve_select_backend hook", rejected)
        _log(selection)
        return selection
    for spec in candidates:
        reason = probe_backend(spec, settings, device, strict=True, registry=registry)
        if reason is None:
            reason = factory_problem(spec)
        if reason is None:
            selection = Selection(spec, device, f"highest-priority available backend on {device}", rejected)
            _log(selection)
            return selection
        rejected[spec.name] = reason
    for known in KNOWN_BACKENDS:
        if known.name not in registry.specs and device in known.devices:
            rejected[known.name] = known.install_hint
    details = "\n".join(f"  {name}: {why}" for name, why in sorted(rejected.items())) or "  (no backends registered)"
    errors = sorted(registry.plugin_errors.items())
    failed = "".join(f"\n  plugin {name!r} failed to load: {why}" for name, why in errors)
    raise BackendUnavailableError(f"no backend can run on {device}:\n{details}{failed}")


def _plugin_errors(registry: BackendRegistry) -> str:
    """The plugins that failed to load or register, as a clause to append to an error (one of them may provide
    the backend asked for); empty when none failed."""
    if not registry.plugin_errors:
        return ""
    errors = ", ".join(f"{name!r} ({error})" for name, error in sorted(registry.plugin_errors.items()))
    return f"; plugins that failed to load (one may provide it): {errors}"


def _did_you_mean(backend: str, device: str, names: Sequence[str]) -> str:
    """A clause suggesting the registered names ``backend`` may mean: a family name (``custom``) gets its member for
    ``device`` (``custom-cpu``), else all its members; anything else the closest spelling; empty when none is
    close."""
    family = [name for name in names if name.startswith(f"{backend}-")]
    if f"{backend}-{device}" in family:
        family = [f"{backend}-{device}"]
    close = family or difflib.get_close_matches(backend, names, n=1)
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(name) for name in close)}?)"


def _select_explicit(settings: CoreSettings, registry: BackendRegistry) -> Selection:
    spec = registry.get(settings.backend)
    if spec is None:
        known = known_backend(settings.backend)
        if known is not None:
            raise BackendUnavailableError(
                f"backend {settings.backend!r}: {known.install_hint}{_plugin_errors(registry)}")
        names = registry.known_names()
        raise ConfigurationError(
            f"unknown BACKEND={settings.backend!r}{_did_you_mean(settings.backend, settings.device, names)}; accepted: "
            f"auto, {', '.join(names)}{_plugin_errors(registry)}"
        )
    problem = capability_problem(spec, settings, registry)
    if problem is not None:  # a setting the named backend cannot honour: a configuration error, not availability
        raise ConfigurationError(problem)
    device = settings.device if settings.device != "auto" else _device_for(spec, settings)
    reason = probe_backend(spec, settings, device, strict=True, registry=registry)
    if reason is not None:
        raise BackendUnavailableError(f"backend {spec.name!r} cannot run on {device}: {reason}")
    selection = Selection(spec, device, f"BACKEND={settings.backend} (explicit)", {})
    _log(selection)
    return selection


def _log(selection: Selection) -> None:
    logger.info(
        "using backend %s on %s (%s); rejected: %s",
        selection.spec.name,
        selection.device,
        selection.reason,
        ", ".join(f"{name} ({why})" for name, why in sorted(selection.rejected.items())) or "none",
    )

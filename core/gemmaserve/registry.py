"""Backend specs and the registry built from every installed plugin.

A :class:`BackendSpec` names its factory and probe as dotted paths (``"pkg.module:attr"``) so that
listing backends never imports torch, transformers, triton or mlx.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gemmaserve.errors import ConfigurationError

if TYPE_CHECKING:
    from gemmaserve.backend import InferenceBackend
    from gemmaserve.settings import CoreSettings

__all__ = ["BackendSpec", "BackendStatus", "BackendRegistry", "KNOWN_BACKENDS", "known_backend", "resolve_dotted",
           "BackendFactory"]

BackendFactory = Callable[[str, str, "CoreSettings"], "InferenceBackend"]
"""``factory(model_path, device, settings) -> InferenceBackend``."""


_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One selectable backend.

    - ``factory``: dotted path of ``factory(model_path, device, settings) -> InferenceBackend``.
    - ``probe``: dotted path of ``probe(settings, device) -> str | None`` returning why the backend
      cannot run (None = it can). Must be cheap; may import heavy packages only to check them.
    - ``devices``: device kinds it runs on (``cpu``, ``cuda``, ``mps``).
    - ``priority``: lower wins when ``BACKEND=auto``.
    - ``requires_model``: False for backends that load no checkpoint (toy/test backends); then no
      default model is prepared for them.
    - ``tensor_parallel``: the factory honours ``TENSOR_PARALLEL_SIZE`` > 1; selection passes any other backend
      over for it (``BACKEND=auto``) or refuses it (an explicit ``BACKEND``).
    - ``expert_parallel``: the factory honours ``ENABLE_EXPERT_PARALLEL`` (MoE experts split whole over the
      tensor-parallel ranks); selection treats any other backend as for ``tensor_parallel``.
    - ``quantization``: the ``QUANTIZATION`` values the factory honours (e.g. ``("fp8",)``); selection passes
      the backend over for any other (``BACKEND=auto`` picks another, an explicit ``BACKEND`` is refused).
    - ``settings``: dotted path of the plugin's pydantic-settings class, if it has one (imported when an engine
      is built; keep its module light). The ``GEMMASERVE_*`` names it reads count as known: ``build_engine``
      refuses any other ``GEMMASERVE_*`` variable as a misspelling.
    """

    name: str
    factory: str
    devices: tuple[str, ...]
    probe: str | None = None
    priority: int = 100
    aliases: tuple[str, ...] = ()
    description: str = ""
    plugin: str = ""
    requires_model: bool = True
    tensor_parallel: bool = False
    expert_parallel: bool = False
    quantization: tuple[str, ...] = ()
    settings: str | None = None

    def __post_init__(self) -> None:
        for key in (self.name, *self.aliases):
            if not _NAME.fullmatch(key):
                raise ValueError(
                    f"backend name {key!r} is not selectable: names and aliases are lower-case letters, digits and "
                    "'-' (BACKEND is normalised to lower case with '_' turned into '-'), e.g. "
                    f"{re.sub('[^a-z0-9-]+', '-', key.lower()).strip('-') or 'my-backend'!r}"
                )
        for role, path in (("factory", self.factory), ("settings", self.settings), ("probe", self.probe)):
            if path is not None and ":" not in path:
                raise ValueError(f"{role} must be a 'module:attribute' path, got {path!r}")
        kinds = ("cpu", "cuda", "mps")
        if isinstance(self.devices, str) or not self.devices or any(d not in kinds for d in self.devices):
            raise ValueError(f"backend {self.name!r}: devices must be a non-empty tuple of {', '.join(kinds)}, "
                             f"got {self.devices!r}")


@dataclass(frozen=True, slots=True)
class KnownBackend:
    """A first-party backend the core knows about even when its plugin is not installed. Its name and
    ``aliases`` are reserved for ``distribution``: no other plugin may register them."""

    name: str
    distribution: str
    extra: str
    source_dir: str
    devices: tuple[str, ...]
    aliases: tuple[str, ...] = ()

    @property
    def install_hint(self) -> str:
        return (
            f'plugin not installed: pip install "gemmaserve[{self.extra}]" '
            f"(from a checkout: pip install -e {self.source_dir})"
        )


KNOWN_BACKENDS: tuple[KnownBackend, ...] = (
    KnownBackend("hf", "gemmaserve-hf-torch", "hf", "plugins/hf_torch", ("cpu", "cuda", "mps"), ("torch", "hf-torch")),
    KnownBackend("custom-cuda", "gemmaserve-custom-torch", "custom-torch", "plugins/custom_torch", ("cuda",)),
    KnownBackend("custom-mps", "gemmaserve-custom-torch", "custom-torch", "plugins/custom_torch", ("mps",)),
    KnownBackend("custom-cpu", "gemmaserve-custom-torch", "custom-torch", "plugins/custom_torch", ("cpu",)),
    KnownBackend("mlx", "gemmaserve-mlx", "mlx", "plugins/mlx", ("mps", "cpu")),
    KnownBackend("mlx-stream", "gemmaserve-mlx", "mlx", "plugins/mlx", ("mps", "cpu")),
)


def known_backend(name: str) -> KnownBackend | None:
    """The first-party backend called ``name`` (a name or alias, as ``BACKEND`` normalises it), or None."""
    name = name.strip().lower().replace("_", "-")
    return next((known for known in KNOWN_BACKENDS if name == known.name or name in known.aliases), None)


def _dist_key(name: str) -> str:
    """A distribution name as packaging normalises it (``Foo_Bar`` == ``foo-bar``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(slots=True)
class BackendStatus:
    """A registry row: the spec (None when the plugin is not installed) and availability."""

    name: str
    plugin: str
    devices: tuple[str, ...]
    available: bool
    reason: str | None
    spec: BackendSpec | None = None


def resolve_dotted(path: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute."""
    module_name, _, attribute = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ImportError(f"{module_name!r} has no attribute {attribute!r} (from {path!r})") from None


@dataclass(slots=True)
class BackendRegistry:
    """Backends registered by plugins, by name and alias. Mutated only while plugins load."""

    specs: dict[str, BackendSpec] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    plugin_errors: dict[str, str] = field(default_factory=dict)

    def add(self, spec: BackendSpec, plugin: str) -> None:
        """Register ``spec`` from ``plugin`` (its distribution name when installed). Raises ConfigurationError
        (nothing registered) for a name or alias taken by another plugin, or a first-party name or alias
        (`KNOWN_BACKENDS`) from any other distribution, so a first-party backend always registers."""
        spec = replace(spec, plugin=plugin)
        for key in (spec.name, *spec.aliases):
            known = known_backend(key)
            if known is not None and _dist_key(plugin) != _dist_key(known.distribution):
                of = "" if key == known.name else f" (an alias of the first-party backend {known.name!r})"
                raise ConfigurationError(
                    f"backend name {key!r}{of} from plugin {plugin!r} is reserved for the first-party distribution "
                    f"{known.distribution!r}; register it under another name"
                )
            owner = self.aliases.get(key) or (key if key in self.specs else None)
            if owner is not None and self.specs[owner].plugin != plugin:
                raise ConfigurationError(
                    f"backend name {key!r} from plugin {plugin!r} is already registered by plugin "
                    f"{self.specs[owner].plugin!r}"
                )
        self.specs[spec.name] = spec
        for alias in spec.aliases:
            self.aliases[alias] = spec.name

    def resolve_name(self, name: str) -> str | None:
        """Canonical name for a name or alias, or None."""
        name = name.strip().lower().replace("_", "-")
        if name in self.specs:
            return name
        return self.aliases.get(name)

    def get(self, name: str) -> BackendSpec | None:
        canonical = self.resolve_name(name)
        return self.specs[canonical] if canonical else None

    def known_names(self) -> list[str]:
        names = set(self.specs) | {known.name for known in KNOWN_BACKENDS}
        return sorted(names)

    def check_integrity(self) -> None:
        for alias, target in self.aliases.items():
            if target not in self.specs:
                raise RuntimeError(f"alias {alias!r} points at unregistered backend {target!r}")
        for name, spec in self.specs.items():
            if spec.name != name:
                raise RuntimeError(f"spec registered as {name!r} is named {spec.name!r}")

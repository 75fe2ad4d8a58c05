"""Plugin loading: pluggy over the ``gemmaserve.backends`` entry-point group.

``load_registry()`` is idempotent: entry points are loaded once per process; a plugin that fails to
import (``SystemExit`` included), implements a hook that is not a hookspec (a misspelt name), or whose hook
raises is recorded with its error in ``plugin_errors`` and the others still load.
"""

from __future__ import annotations

import logging
import threading
import traceback
from importlib.metadata import entry_points
from types import ModuleType

import pluggy

from gemmaserve import hookspecs
from gemmaserve.registry import BackendRegistry, BackendSpec

__all__ = ["ENTRY_POINT_GROUP", "get_plugin_manager", "load_registry", "register_plugin", "reset_plugins"]

ENTRY_POINT_GROUP = "gemmaserve.backends"
logger = logging.getLogger(__name__)

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_load_errors: dict[str, str] = {}
_distributions: dict[str, str] = {}  # entry-point name -> the distribution that ships it
_registry: BackendRegistry | None = None


def _new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return manager


def _register(manager: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register ``plugin`` as ``name``, validated now: a hook implementation that no hookspec declares (unless
    ``optionalhook``) unregisters it again and raises ``pluggy.PluginValidationError`` naming the hook, so one
    misspelt plugin never fails the others (pluggy's ``check_pending`` checks every plugin at once)."""
    manager.register(plugin, name=name)
    unknown = sorted(
        caller.name for caller in manager.get_hookcallers(plugin) or []
        if not caller.has_spec()
        and any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls())
    )
    if unknown:
        manager.unregister(plugin)
        known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith(f"{hookspecs.PROJECT_NAME}_")))
        raise pluggy.PluginValidationError(
            plugin, f"unknown hook {', '.join(map(repr, unknown))} (not a hookspec; the hooks are: {known})")


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager with every installed entry point loaded (once)."""
    global _manager
    with _lock:
        if _manager is None:
            manager = _new_manager()
            for entry_point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
                if manager.get_plugin(entry_point.name) is not None:
                    continue
                try:
                    _register(manager, entry_point.load(), entry_point.name)
                    if entry_point.dist is not None:
                        _distributions[entry_point.name] = entry_point.dist.name
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # a broken plugin (even one that calls sys.exit) must not stop the rest
                    _load_errors[entry_point.name] = f"{type(exc).__name__}: {exc}"
                    logger.warning("plugin %r failed to load: %s", entry_point.name, exc)
                    logger.debug("%s", traceback.format_exc())
            _manager = manager
        return _manager


def register_plugin(module: ModuleType | object, name: str) -> None:
    """Register a plugin object explicitly (tests, embedding). Invalidates the cached registry. Raises
    ``pluggy.PluginValidationError`` (nothing registered) for a hook implementation no hookspec declares."""
    global _registry
    manager = get_plugin_manager()
    with _lock:
        if manager.get_plugin(name) is None:
            _register(manager, module, name)
        _registry = None


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered by name. Invalidates the cached registry."""
    global _registry
    manager = get_plugin_manager()
    with _lock:
        plugin = manager.get_plugin(name)
        if plugin is not None:
            manager.unregister(plugin)
        _registry = None


def reset_plugins() -> None:
    """Forget loaded plugins (tests). The next call reloads entry points."""
    global _manager, _registry
    with _lock:
        _manager = None
        _registry = None
        _load_errors.clear()
        _distributions.clear()


def load_registry() -> BackendRegistry:
    """Collect every plugin's backends into a registry (cached until plugins change)."""
    global _registry
    manager = get_plugin_manager()
    with _lock:
        if _registry is not None:
            return _registry
        registry = BackendRegistry(plugin_errors=dict(_load_errors))
        named = sorted(((manager.get_name(p) or repr(p)), p) for p in manager.get_plugins())
        for plugin_name, plugin in named:
            hook = getattr(plugin, "gemmaserve_register_backends", None)
            if hook is None:
                continue
            collected: list[BackendSpec] = []
            try:
                hook(register=collected.append)
                for spec in collected:
                    registry.add(spec, _distributions.get(plugin_name, plugin_name))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                registry.plugin_errors[plugin_name] = f"{type(exc).__name__}: {exc}"
                logger.warning("plugin %r failed to register backends: %s", plugin_name, exc)
        registry.check_integrity()
        _registry = registry
        return registry

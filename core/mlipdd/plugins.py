"""Plugin manager and registry: find plugins, collect what they register, look it up.

Discovery order: the built-in plugin, then every entry point of group ``"mlipdd"``
(its value is a module path; the module is the plugin), then plugins registered by
hand with :func:`register_plugin` (test fixtures). A plugin that fails to import is
reported (a warning, and an entry in ``registry().failed``) and skipped, so one broken
third-party package never takes the others down. ``MLIPDD_DISABLE_PLUGIN_AUTOLOAD=1``
turns entry-point discovery off; the built-in plugin stays.

The registry is built once and cached; :func:`reset_registry` forgets it (and the
manager) so the next call discovers again.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pluggy

from mlipdd import hookspecs
from mlipdd.data import InputError
from mlipdd.hookspecs import PROJECT_NAME, hookimpl

__all__ = ["AUTOLOAD_ENV_VAR", "ENTRY_POINT_GROUP", "ModelArgumentError", "PluginError",
           "UnknownNameError", "create_model", "get_plugin_manager", "get_preset", "get_strategy",
           "hookimpl", "register_plugin", "registry", "reset_registry", "unregister_plugin",
           "wrap_model"]

ENTRY_POINT_GROUP = "mlipdd"
AUTOLOAD_ENV_VAR = "MLIPDD_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_PLUGIN_NAME = "builtin"

# Which extra to suggest when nobody recognises an object from this top-level package.
# Only a hint in an error message: the core never imports a plugin by name.
_INSTALL_HINTS = {
    "mace": "mlipdd[mace]",
    "fairchem": "mlipdd[uma]",
    "aimnet": "mlipdd[aimnet2]",
    "aimnet2": "mlipdd[aimnet2]",
}


class PluginError(RuntimeError):
    """A plugin misbehaved, or asked-for plugin content does not exist."""


class UnknownNameError(PluginError, LookupError):
    """A model or preset name that no loaded plugin registered."""


class ModelArgumentError(PluginError, InputError):
    """A model factory given arguments it does not take or cannot use (bad input)."""


class ModelEntry(NamedTuple):
    factory: Callable[..., Any]
    description: str
    plugin: str


class StrategyEntry(NamedTuple):
    cls: type
    description: str
    plugin: str


class PluginInfo(NamedTuple):
    name: str
    dist: str | None  # None for plugins registered by hand
    version: str | None


class FailedPlugin(NamedTuple):
    name: str
    error: str


@dataclass
class Registry:
    """Everything the loaded plugins registered. Built by :func:`registry`."""

    models: dict[str, ModelEntry] = field(default_factory=dict)
    presets: dict[str, object] = field(default_factory=dict)
    preset_plugins: dict[str, str] = field(default_factory=dict)
    strategies: dict[str, StrategyEntry] = field(default_factory=dict)
    spec_modules: set[str] = field(default_factory=set)
    spec_patch_modules: set[str] = field(default_factory=set)  # patch targets only, never replacements
    plugins: list[PluginInfo] = field(default_factory=list)
    failed: list[FailedPlugin] = field(default_factory=list)


# Module state. NOTE [one manager per process]: hooks are process-global on purpose;
# every rank of a distributed run discovers the same plugins from the same install.
_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None
_plugin_info: dict[str, PluginInfo] = {}
_load_failures: list[FailedPlugin] = []
_manual_plugins: dict[str, object] = {}  # survive reset_registry(), until unregistered


def autoload_disabled() -> bool:
    value = os.environ.get(AUTOLOAD_ENV_VAR, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created and populated on first use."""
    global _manager
    if _manager is None:
        _manager = _new_manager()
    return _manager


def _new_manager() -> pluggy.PluginManager:
    _plugin_info.clear()
    _load_failures.clear()
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    from mlipdd import __version__, builtin_plugin

    _add_plugin(
        manager,
        builtin_plugin,
        BUILTIN_PLUGIN_NAME,
        PluginInfo(BUILTIN_PLUGIN_NAME, "mlipdd", __version__),
    )
    if not autoload_disabled():
        _load_entry_points(manager)
    for name, plugin in _manual_plugins.items():
        _add_plugin(manager, plugin, name, PluginInfo(name, None, None))
    return manager


def _load_entry_points(manager: pluggy.PluginManager) -> None:
    # A dist installed after interpreter start (tests, notebooks) is otherwise missed.
    importlib.invalidate_caches()
    seen: dict[str, str | None] = {}  # entry-point name -> dist that claimed it
    # Sorted by name so every machine (and every rank) registers in the same order.
    entry_points = sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name
    )
    for entry_point in entry_points:
        dist = getattr(entry_point, "dist", None)
        info = PluginInfo(
            entry_point.name,
            dist.metadata["Name"] if dist is not None else None,
            dist.version if dist is not None else None,
        )
        if entry_point.name in seen:
            # The same dist visible twice on sys.path (editable + regular) is not a clash.
            if seen[entry_point.name] != info.dist:
                _report_failure(
                    info,
                    f"plugin name {entry_point.name!r} is already taken by "
                    f"{seen[entry_point.name]}; uninstall one of the two distributions",
                )
            continue
        seen[entry_point.name] = info.dist
        try:
            plugin = entry_point.load()
        except Exception as exc:  # noqa: BLE001 - any import-time error means "skip it"
            _report_failure(
                info, f"import of {entry_point.value!r} failed: {type(exc).__name__}: {exc}"
            )
            continue
        _add_plugin(manager, plugin, entry_point.name, info)


def _add_plugin(manager: pluggy.PluginManager, plugin: object, name: str, info: PluginInfo) -> None:
    if manager.has_plugin(name):
        _report_failure(info, f"another plugin is already registered under the name {name!r}")
        return
    try:
        manager.register(plugin, name=name)
    except Exception as exc:  # noqa: BLE001 - pluggy validation errors: bad hook signature
        _report_failure(info, f"{type(exc).__name__}: {exc}")
        return
    unknown = [
        caller.name for caller in manager.get_hookcallers(plugin) or [] if not caller.has_spec()
    ]
    if unknown:
        manager.unregister(plugin)
        known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("mlipdd_")))
        _report_failure(
            info, f"implements unknown hook(s) {', '.join(unknown)}; known hooks: {known}"
        )
        return
    _plugin_info[name] = info


def _report_failure(info: PluginInfo, error: str) -> None:
    _load_failures.append(FailedPlugin(info.name, error))
    dist = f" (from {info.dist} {info.version})" if info.dist else ""
    warnings.warn(
        f"mlipdd plugin {info.name!r}{dist} skipped: {error}", RuntimeWarning, stacklevel=2
    )


def registry() -> Registry:
    """What all loaded plugins registered (cached; see :func:`reset_registry`)."""
    global _registry
    if _registry is None:
        _registry = _build_registry(get_plugin_manager())
    return _registry


def _build_registry(manager: pluggy.PluginManager) -> Registry:
    reg = Registry()
    # NOTE [name clashes]: every registration is collected first, as (kind, name) ->
    # [(plugin, value)], and only then checked, so the verdict does not depend on the
    # order plugins load in. A name two plugins claim is nobody's: both plugins are
    # disabled whole (reported in `Registry.failed`, so `mlipdd plugins --strict` exits 1)
    # and everything else keeps working. The built-in plugin is never disabled: a plugin
    # claiming a core name (lj, halo) is the one that goes.
    claims: dict[tuple[str, str], list[tuple[str, object]]] = {}
    spec_module_sources: list[tuple[str, str, bool]] = []  # (module, plugin, patch_only), filtered at the end

    def claim(kind: str, name: str, plugin: str, value: object) -> None:
        _check_name(kind, name, plugin)
        claims.setdefault((kind, name), []).append((plugin, value))

    def model_registrar(plugin: str):
        def register(name: str, factory: Callable[..., Any], description: str = "") -> None:
            if not callable(factory):
                raise PluginError(
                    f"plugin {plugin!r} registered model {name!r} with a non-callable factory {factory!r}"
                )
            claim("model", name, plugin, ModelEntry(factory, description, plugin))

        return register

    def preset_registrar(plugin: str):
        def register(name: str, spec: object) -> None:
            claim("preset", name, plugin, spec)

        return register

    def strategy_registrar(plugin: str):
        def register(name: str, strategy: type, description: str = "") -> None:
            from mlipdd.strategy.base import Strategy

            _check_name("strategy", name, plugin)
            if not (isinstance(strategy, type) and issubclass(strategy, Strategy)):
                raise PluginError(
                    f"plugin {plugin!r} registered strategy {name!r} as {strategy!r}, which is not a "
                    "subclass of mlipdd.strategy.Strategy; subclass it and implement its abstract methods"
                )
            claim("strategy", name, plugin, StrategyEntry(strategy, description, plugin))

        return register

    def spec_module_registrar(plugin: str):
        def register(module_path: str, *, patch_only: bool = False) -> None:
            if not isinstance(module_path, str) or not all(
                p.isidentifier() for p in module_path.split(".")
            ):
                raise PluginError(
                    f"plugin {plugin!r} allow-listed {module_path!r}, which is not a dotted module path"
                )
            if not isinstance(patch_only, bool):
                raise PluginError(
                    f"plugin {plugin!r} allow-listed {module_path!r} with patch_only={patch_only!r}; "
                    "pass True or False"
                )
            spec_module_sources.append((module_path, plugin, patch_only))

        return register

    broken: set[str] = set()
    for hook_name, make_registrar in (
        ("mlipdd_register_models", model_registrar),
        ("mlipdd_register_presets", preset_registrar),
        ("mlipdd_register_strategies", strategy_registrar),
        ("mlipdd_register_spec_modules", spec_module_registrar),
    ):
        # Call each implementation ourselves (in registration order) rather than through
        # pluggy's fan-out, so the callback knows which plugin is registering.
        for impl in getattr(manager.hook, hook_name).get_hookimpls():
            if impl.plugin_name in broken or impl.hookwrapper or impl.wrapper:
                continue
            register = make_registrar(impl.plugin_name)
            try:
                impl.function(**{arg: register for arg in impl.argnames})
            except PluginError:
                raise  # a malformed registration is an error of the plugin's code, not a skip
            except Exception as exc:  # noqa: BLE001 - a crashing plugin is skipped, not fatal
                _disable(manager, broken, impl.plugin_name, f"{hook_name} raised {type(exc).__name__}: {exc}")
    for (kind, name), contenders in sorted(claims.items()):
        owners = [plugin for plugin, _ in contenders if plugin not in broken]
        if len(owners) > 1:
            clash = _clash_message(kind, name, owners)
            for plugin in dict.fromkeys(owners):  # each plugin once, in order
                if plugin != BUILTIN_PLUGIN_NAME:
                    _disable(manager, broken, plugin, clash)
    for (kind, name), contenders in sorted(claims.items()):
        for plugin, value in contenders:
            if plugin in broken:
                continue
            if kind == "model":
                reg.models[name] = value
            elif kind == "preset":
                reg.presets[name], reg.preset_plugins[name] = value, plugin
            else:
                reg.strategies[name] = value
    # A plugin that was disabled part-way is skipped whole: drop what it did register.
    kept = [(module, patch_only) for module, plugin, patch_only in spec_module_sources if plugin not in broken]
    reg.spec_modules = {module for module, patch_only in kept if not patch_only}
    reg.spec_patch_modules = {module for module, patch_only in kept if patch_only} - reg.spec_modules
    reg.plugins = list(_plugin_info.values())
    reg.failed = list(_load_failures)
    return reg


def _disable(manager: pluggy.PluginManager, broken: set[str], plugin: str, why: str) -> None:
    """Skip ``plugin`` like one that failed to import: reported, out of the manager too,
    so its lookup hooks (wrap_model) are not asked either."""
    if plugin in broken:
        return
    broken.add(plugin)
    _report_failure(_plugin_info.pop(plugin, PluginInfo(plugin, None, None)), why)
    if manager.has_plugin(plugin):
        manager.unregister(name=plugin)


def _clash_message(kind: str, name: str, owners: list[str]) -> str:
    distinct = list(dict.fromkeys(owners))
    if len(distinct) == 1:
        return f"registers {kind} {name!r} twice; register each name once"
    who = " and ".join(f"plugin {p!r}" for p in distinct)
    core = BUILTIN_PLUGIN_NAME in distinct
    disabled = ("the plugin that shadows the core's name is disabled" if core
                else "both are disabled, the other plugins work")
    return (f"{kind} {name!r} is registered by both {who}: {disabled}; uninstall one of them, "
            f"or disable autoload ({AUTOLOAD_ENV_VAR}=1) and register the one you want by hand")


def _check_name(kind: str, name: object, plugin: str) -> None:
    if not isinstance(name, str) or not name:
        raise PluginError(
            f"plugin {plugin!r} registered a {kind} with an invalid name {name!r}; use a non-empty str"
        )


def reset_registry() -> None:
    """Forget the registry and the manager; the next call discovers plugins again.

    Plugins added with :func:`register_plugin` are kept until :func:`unregister_plugin`.
    """
    global _manager, _registry
    _manager = None
    _registry = None


def register_plugin(plugin: object, name: str) -> None:
    """Register a plugin module or object by hand (test fixtures, notebooks)."""
    if name in _manual_plugins:
        raise PluginError(
            f"a plugin named {name!r} is already registered by hand; unregister_plugin({name!r}) first"
        )
    _manual_plugins[name] = plugin
    global _registry
    _registry = None
    if _manager is not None:
        _add_plugin(_manager, plugin, name, PluginInfo(name, None, None))


def unregister_plugin(name: str) -> None:
    """Undo :func:`register_plugin` (or drop a discovered plugin) by name."""
    global _registry
    _manual_plugins.pop(name, None)
    _plugin_info.pop(name, None)
    _load_failures[:] = [failure for failure in _load_failures if failure.name != name]
    if _manager is not None and _manager.has_plugin(name):
        _manager.unregister(name=name)
    _registry = None


def create_model(name: str, **kwargs: Any):
    """Build the model registered as ``name``; ``kwargs`` go to its factory.

    An argument the factory does not take, or a factory that refuses its arguments (a
    value of the wrong type, a missing or unreadable model file), is a `ModelArgumentError`
    naming the model, the arguments and the factory's own message: bad input, not a bug.
    """
    reg = registry()
    if name not in reg.models:
        raise UnknownNameError(_unknown_message("model", name, reg.models, reg))
    factory = reg.models[name].factory
    _check_argument_names(name, factory, kwargs)
    try:
        return factory(**kwargs)
    except InputError:
        raise  # already says what is wrong and how to fix it
    except _FACTORY_REFUSALS as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments"
        first_line = (str(exc).strip().splitlines() or [""])[0]
        # a file that exists but does not load is most often not a model file at all
        files = [v for v in kwargs.values() if isinstance(v, (str, os.PathLike)) and os.path.isfile(v)]
        hint = f" (is {str(files[0])!r} a model file that {name!r} reads, whole?)" if files else ""
        raise ModelArgumentError(
            f"model {name!r} could not be built from {given}: {type(exc).__name__}: {first_line}{hint}"
        ) from exc


# What a factory raises for arguments it cannot use: a bad value (TypeError, ValueError),
# a missing or unreadable file (OSError), a corrupt one (torch.load / pickle: EOFError,
# UnpicklingError, RuntimeError from the zip reader, KeyError), a missing upstream package.
_FACTORY_REFUSALS = (
    TypeError, ValueError, OSError, EOFError, pickle.UnpicklingError, RuntimeError, KeyError, ImportError,
)


def _check_argument_names(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Refuse a keyword the factory's signature lacks, listing the ones it takes."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ModelArgumentError(
            f"model {name!r} takes no argument {', '.join(map(repr, unknown))}; "
            f"its arguments are {', '.join(accepted) or '(none)'}"
        )


def get_preset(name: str) -> object:
    """The distribution spec registered as preset ``name``."""
    reg = registry()
    if name not in reg.presets:
        raise UnknownNameError(_unknown_message("preset", name, reg.presets, reg))
    return reg.presets[name]


def get_strategy(name: str) -> type:
    """The strategy class registered as ``name`` (``"halo"``, ``"sharded"``, a plugin's)."""
    reg = registry()
    if name not in reg.strategies:
        raise UnknownNameError(_unknown_message("strategy", name, reg.strategies, reg))
    return reg.strategies[name].cls


def _unknown_message(kind: str, name: str, known: dict, reg: Registry) -> str:
    listed = ", ".join(sorted(known)) or "(none)"
    kinds = "strategies" if kind == "strategy" else f"{kind}s"
    message = f"unknown {kind} {name!r}; known {kinds}: {listed}. `mlipdd plugins` shows what is installed."
    if reg.failed:
        failed = "; ".join(f"{f.name}: {f.error}" for f in reg.failed)
        message += f" Some plugins failed to load and may have provided it: {failed}"
    return message


def wrap_model(model: object, **options: Any):
    """Return ``model`` as a ``ModelWrapper``, asking plugins to wrap raw upstream models."""
    from mlipdd.models.base import ModelWrapper

    if isinstance(model, ModelWrapper):
        return model
    registry()  # surfaces load failures and duplicates before the lookup
    wrapped = get_plugin_manager().hook.mlipdd_wrap_model(model=model, options=options)
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    if wrapped is None:
        top = type(model).__module__.split(".")[0]
        hint = _INSTALL_HINTS.get(top)
        fix = (
            f"install it with `pip install '{hint}'`"
            if hint
            else "install the mlipdd plugin for that model family"
        )
        raise PluginError(
            f"no installed mlipdd plugin recognises a model of type {kind}; {fix}, "
            "or pass a ModelWrapper. `mlipdd plugins` lists the installed plugins."
        )
    if not isinstance(wrapped, ModelWrapper):
        raise PluginError(
            f"a plugin's mlipdd_wrap_model returned {type(wrapped).__name__} for {kind}; it must return a ModelWrapper"
        )
    return wrapped

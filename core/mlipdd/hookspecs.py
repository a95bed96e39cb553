"""Hook specifications: the whole contract between the mlipdd core and its plugins.

A plugin is a module (or any object) whose functions carry the ``@hookimpl`` marker
and are named after one of the hooks below. Installed plugins are found through the
entry-point group ``"mlipdd"``; see ``mlipdd.plugins`` for discovery and the registry.

Two kinds of hooks:

* **Registration hooks** (``mlipdd_register_*``) receive a ``register`` callback.
  The plugin calls it once per thing it provides. The core, not the plugin, owns the
  namespace: a second registration of the same name raises an error naming both
  plugins, so two plugins can never silently shadow each other.
* **Lookup hooks** are ``firstresult=True``: plugins are asked in turn and the first
  non-``None`` answer wins.

Built-in models, presets and strategies register through these same hooks
(``mlipdd.builtin_plugin``), so the core gets no privileged back door.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:  # only for annotations: keep this module import-light
    from mlipdd.models.base import ModelWrapper
    from mlipdd.strategy.base import Strategy

PROJECT_NAME = "mlipdd"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterModel(Protocol):
    """Signature of the callback handed to :func:`mlipdd_register_models`."""

    def __call__(
        self, name: str, factory: Callable[..., ModelWrapper], description: str = ""
    ) -> None: ...


class RegisterPreset(Protocol):
    """Signature of the callback handed to :func:`mlipdd_register_presets`."""

    def __call__(self, name: str, spec: object) -> None: ...


class RegisterSpecModule(Protocol):
    """Signature of the callback handed to :func:`mlipdd_register_spec_modules`."""

    def __call__(self, module_path: str, *, patch_only: bool = False) -> None: ...


class RegisterStrategy(Protocol):
    """Signature of the callback handed to :func:`mlipdd_register_strategies`."""

    def __call__(self, name: str, strategy: type[Strategy], description: str = "") -> None: ...


# ---------------------------------------------------------------------------
# Registration hooks: called once when the registry is built.
# ---------------------------------------------------------------------------


@hookspec
def mlipdd_register_models(register: RegisterModel) -> None:
    """Register model factories under a name.

    Call ``register(name, factory, description="")`` once per model family or
    variant. ``factory(**kwargs)`` must return a ``ModelWrapper``;
    ``mlipdd.plugins.create_model(name, **kwargs)`` calls it. Import heavy upstream
    packages inside the factory, not at plugin import time, so that listing plugins
    stays fast and a missing upstream package only fails when that model is used.

    A name another plugin registers too is a clash: both plugins are disabled and
    reported (NOTE [name clashes] in ``mlipdd.plugins``); a core name stays the core's.

    :param register: callback ``(name: str, factory, description: str = "") -> None``.
    """


@hookspec
def mlipdd_register_presets(register: RegisterPreset) -> None:
    """Register named distribution presets.

    Call ``register(name, spec)`` where ``spec`` is an ``mlipdd.spec.MLIPSpec``;
    ``mlipdd.plugins.get_preset(name)`` returns it. By convention preset names are
    upper case with a ``SPEC_`` prefix, e.g. ``SPEC_MPNN_HALO``.

    A name another plugin registers too is a clash: both plugins are disabled and
    reported (NOTE [name clashes] in ``mlipdd.plugins``); a core name stays the core's.

    :param register: callback ``(name: str, spec: MLIPSpec) -> None``.
    """


@hookspec
def mlipdd_register_spec_modules(register: RegisterSpecModule) -> None:
    """Allow-list modules that a saved spec file may reference.

    Spec files are input, not code: loading one may only resolve objects *defined* in
    an allow-listed module (or a submodule of one), of the kind the file declares (a
    replacement must be a function defined there, a patched class a class defined
    there); a name an allow-listed module merely re-exports is refused. Allow-list
    exactly the modules your presets name, not whole upstream packages:

    * ``register("mlipdd_<name>.adapters")``: a module of your own whose functions are
      adapter replacements (named in a file's ``replacement``);
    * ``register("upstream.module", patch_only=True)``: a module whose functions or
      classes your adapters patch (named in a file's ``module_path``); its functions can
      then be replaced, never called in place of another.

    Every preset the plugin registers must save and load again
    (``MLIPSpec.load(path) == preset``). Registering the same module twice is harmless;
    a module registered both ways is allow-listed in full.

    :param register: callback ``(module_path: str, *, patch_only: bool = False) -> None``.
    """


@hookspec
def mlipdd_register_strategies(register: RegisterStrategy) -> None:
    """Register domain-decomposition strategies under a name.

    Call ``register(name, strategy_cls, description="")`` once per strategy.
    ``strategy_cls`` must subclass ``mlipdd.strategy.Strategy`` (an abstract base
    class: ``from_config``, ``accepts``, ``partition``, ``prepare``, ``model_batch``,
    ``consolidate``, optionally ``model_scope``); ``DomainConfig(strategy=name)``
    then selects it and ``DistributedModel`` drives it. The built-in ``"halo"``,
    ``"sharded"`` and ``"graph_partition"`` register through this hook too. A
    strategy built on spatial ownership composes ``mlipdd.strategy.HaloPlanner``.

    A name another plugin registers too is a clash: both plugins are disabled and
    reported (NOTE [name clashes] in ``mlipdd.plugins``); a core name stays the core's.
    A class that is not a ``Strategy`` subclass raises ``PluginError``.

    :param register: callback ``(name: str, strategy_cls, description: str = "") -> None``.
    """


# ---------------------------------------------------------------------------
# Lookup hooks: called on demand, first non-None result wins.
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def mlipdd_wrap_model(model: object, options: dict) -> ModelWrapper | None:
    """Wrap a raw third-party model object into a ``ModelWrapper``.

    Return a wrapper if this plugin recognises ``type(model)`` (e.g. a mace
    ``ScaleShiftMACE``), otherwise return ``None`` so the next plugin is asked.
    Recognise by type without importing the upstream package when it is not
    already imported (check ``type(model).__module__`` first): a user who never
    touches MACE should not pay for importing it.

    ``firstresult``: the first non-``None`` answer is used and the rest of the
    plugins are not asked.

    :param model: the object the user passed to ``mlipdd.plugins.wrap_model``.
    :param options: keyword options given by the user, passed through unchanged
        (for example ``dtype`` or ``head``); ignore those you do not know.
    :return: a ``ModelWrapper`` or ``None``.
    """

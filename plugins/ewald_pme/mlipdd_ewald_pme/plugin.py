"""Hook implementations of the Ewald / PME plugin (entry point ``ewald_pme``).

Skeleton: every hook is implemented and registers nothing yet, so the plugin is
discovered and listed while its content lands in its own issue.
"""

from __future__ import annotations

from mlipdd import hookimpl
from mlipdd.hookspecs import RegisterModel, RegisterPreset, RegisterSpecModule


@hookimpl
def mlipdd_register_models(register: RegisterModel) -> None:
    """No models yet: content lands in its own issue."""


@hookimpl
def mlipdd_register_presets(register: RegisterPreset) -> None:
    """No presets yet: content lands in its own issue."""


@hookimpl
def mlipdd_register_spec_modules(register: RegisterSpecModule) -> None:
    """No spec modules yet: content lands in its own issue."""


@hookimpl
def mlipdd_wrap_model(model: object, options: dict) -> None:
    """Recognises no upstream model yet: content lands in its own issue."""
    return

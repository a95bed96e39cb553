"""The one error type of the spec layer."""

from __future__ import annotations

from mlipdd.data import InputError


class SpecError(InputError):
    """A spec, adapter or spec file is wrong; the message names the problem and the fix."""

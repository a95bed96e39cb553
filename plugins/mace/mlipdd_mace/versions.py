"""Upstream versions this plugin is tested against, checked when a model is wrapped.

mace-torch is deliberately not a declared dependency: it pins ``e3nn==0.4.4`` while
fairchem (UMA plugin) needs ``e3nn>=0.5``, so declaring it would make
``pip install mlipdd[mace,uma]`` unresolvable. mace runs correctly on e3nn 0.6, so the
supported install puts mace-torch in with ``--no-deps`` next to e3nn 0.6 (see README).
Because pip cannot enforce the range, it is checked here instead.
"""

from __future__ import annotations

import warnings
from importlib import metadata

SUPPORTED_MACE = ">=0.3.14,<0.4"
SUPPORTED_E3NN = ">=0.5,<0.7"

_INSTALL_HINT = (
    "install it without its e3nn pin: `pip install --no-deps 'mace-torch" + SUPPORTED_MACE + "'` "
    "plus its runtime dependencies and `pip install 'e3nn" + SUPPORTED_E3NN + "'` "
    "(or run `make install` at the repository root); see plugins/mace/README.md"
)


class UnsupportedVersionWarning(UserWarning):
    """An upstream package is outside the range this plugin is tested against."""


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _in_range(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def require_mace() -> str:
    """Return the installed mace-torch version; raise ImportError naming the fix if absent.

    Outside `SUPPORTED_MACE` (or e3nn outside `SUPPORTED_E3NN`) only warns: a newer mace
    may well work, and the comparison tests against mace's own calculator will tell.
    """
    version = _installed("mace-torch")
    if version is None:
        raise ImportError(
            f"mlipdd-mace needs mace-torch {SUPPORTED_MACE}, which is not installed; {_INSTALL_HINT}"
        )
    if not _in_range(version, SUPPORTED_MACE):
        warnings.warn(
            f"mace-torch {version} is outside the range mlipdd-mace is tested against "
            f"({SUPPORTED_MACE}); results may differ. {_INSTALL_HINT}",
            UnsupportedVersionWarning,
            stacklevel=3,
        )
    e3nn_version = _installed("e3nn")
    if e3nn_version is not None and not _in_range(e3nn_version, SUPPORTED_E3NN):
        warnings.warn(
            f"e3nn {e3nn_version} is outside the range mlipdd-mace is tested against "
            f"({SUPPORTED_E3NN}); {_INSTALL_HINT}",
            UnsupportedVersionWarning,
            stacklevel=3,
        )
    return version

"""The fairchem-core versions this plugin is written and tested against, checked at wrap time.

The halo and graph-partition adapters replace a handful of fairchem functions and
methods by name (see `mlipdd_uma.halo`); their signatures and the way the eSCN-MD
backbone calls them change between fairchem releases, so a version outside the range
is refused rather than run into a silently wrong number.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_FAIRCHEM = ">=2.24.0,<2.25"

_INSTALL_HINT = f"install a supported release: `pip install 'fairchem-core{SUPPORTED_FAIRCHEM}'`"


class UnsupportedFairchemError(ImportError):
    """fairchem-core is missing or outside `SUPPORTED_FAIRCHEM`."""


def installed_fairchem() -> str | None:
    try:
        return metadata.version("fairchem-core")
    except metadata.PackageNotFoundError:
        return None


def require_fairchem(version: str | None = None) -> str:
    """Return the installed fairchem-core version; raise naming the fix when unsupported.

    ``version`` overrides what is installed (for tests of this check).
    """
    from packaging.specifiers import SpecifierSet

    version = version if version is not None else installed_fairchem()
    if version is None:
        raise UnsupportedFairchemError(
            f"mlipdd-uma needs fairchem-core {SUPPORTED_FAIRCHEM}, which is not installed; {_INSTALL_HINT}"
        )
    if not SpecifierSet(SUPPORTED_FAIRCHEM).contains(version, prereleases=True):
        raise UnsupportedFairchemError(
            f"fairchem-core {version} is outside the range mlipdd-uma supports ({SUPPORTED_FAIRCHEM}): "
            "its distributed adapters patch fairchem internals by name and were not checked against "
            f"this release; {_INSTALL_HINT}"
        )
    return version

"""The aimnet release this plugin is written and tested against, checked when a model is wrapped.

aimnet 0.2.5 installs next to torch 2.13.0, e3nn 0.6.0, mace-torch and fairchem-core
as declared (no override): its own dependencies (nvalchemi-toolkit-ops, warp-lang, ...)
are the ones fairchem-core already brings.
"""

from __future__ import annotations

import warnings
from importlib import metadata

SUPPORTED_AIMNET = ">=0.2.5,<0.3"
_INSTALL_HINT = f"install it with `pip install 'aimnet{SUPPORTED_AIMNET}'` (or `make install` at the repository root)"


class UnsupportedVersionWarning(UserWarning):
    """aimnet is outside the range this plugin is tested against."""


def require_aimnet() -> str:
    """The installed aimnet version; ImportError naming the fix when it is missing.

    Outside `SUPPORTED_AIMNET` only warns: the comparison tests against aimnet's own
    forward and calculator say whether a newer release still matches.
    """
    try:
        version = metadata.version("aimnet")
    except metadata.PackageNotFoundError:
        raise ImportError(f"mlipdd-aimnet2 needs aimnet {SUPPORTED_AIMNET}, which is not installed; {_INSTALL_HINT}") from None
    from packaging.specifiers import SpecifierSet

    if not SpecifierSet(SUPPORTED_AIMNET).contains(version, prereleases=True):
        warnings.warn(
            f"aimnet {version} is outside the range mlipdd-aimnet2 is tested against ({SUPPORTED_AIMNET}); "
            f"results may differ. {_INSTALL_HINT}",
            UnsupportedVersionWarning,
            stacklevel=3,
        )
    return version

"""Pretrained MACE foundation models, fetched through mace's own loaders.

mace owns the list of released checkpoints, their URLs, licences and the cache
(``$XDG_CACHE_HOME/mace``); going through its functions means a new mace release brings
its new models along. A name picks a family and a model within it:

* ``"medium-mpa-0"``, ``"small"``, ``"medium-0b3"``, ... or ``"mp:<name>"``: MACE-MP family
  (`mace.calculators.foundations_models.mace_mp`);
* ``"off:small"`` / ``"off:medium"`` / ``"off:large"``: MACE-OFF23 (``mace_off``);
* ``"omol:extra_large"``: MACE-OMOL (``mace_omol``).
"""

from __future__ import annotations

import torch

FAMILIES = ("mp", "off", "omol")


def split_foundation_name(name: str) -> tuple[str, str | None]:
    """``"off:small"`` -> ``("off", "small")``; a bare name belongs to the MP family."""
    family, sep, model = name.partition(":")
    if not sep:
        return "mp", name or None
    if family not in FAMILIES:
        raise ValueError(
            f"unknown MACE foundation family {family!r} in {name!r}; use one of "
            f"{', '.join(f'{f}:<model>' for f in FAMILIES)}, or a bare MACE-MP name such as 'medium-mpa-0'"
        )
    return family, model or None


def known_foundation_names() -> list[str]:
    """Every name mace 0.3.x knows how to download, in the form `load_foundation` takes."""
    from mace.calculators import foundations_models as fm

    names = [n for n in fm.mace_mp_names if n is not None]
    names += [f"off:{n}" for n in fm.mace_off_urls]
    names += ["omol:extra_large"]
    return names


def load_foundation(name: str, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The raw mace model called ``name``, downloaded into mace's cache on first use.

    Raises RuntimeError naming the model and the way out when the download fails (no
    network, as on compute nodes): fetch the file elsewhere and use a path instead.
    """
    from mace.calculators import foundations_models as fm

    family, model = split_foundation_name(name)
    if family == "mp" and model not in fm.mace_mp_names:
        raise ValueError(
            f"unknown MACE-MP foundation model {model!r}; known names: {known_foundation_names()}"
        )
    if family == "off" and model is not None and model not in fm.mace_off_urls:
        raise ValueError(f"unknown MACE-OFF model {model!r}; known: {sorted(fm.mace_off_urls)}")
    loader = {"mp": fm.mace_mp, "off": fm.mace_off, "omol": fm.mace_omol}[family]
    try:
        # mace sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD on import, so its torch.load of the
        # full pickled module works on torch>=2.6; the file comes from mace's release URL.
        return loader(model=model, device=str(device), return_raw_model=True)
    except (RuntimeError, OSError) as exc:
        from mace.tools.utils import get_cache_dir

        raise RuntimeError(
            f"could not load MACE foundation model {name!r}: the download failed ({exc.__cause__ or exc}). "
            "On a machine without network access, download the checkpoint elsewhere and either "
            f"place it in mace's cache directory ({get_cache_dir()}) or load it with "
            "MACEWrapper.from_file(path)"
        ) from exc

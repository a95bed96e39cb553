"""AIMNet2 models with seeded random weights, built from aimnet's own model configs.

No weights can be downloaded in tests, so a model is built from the YAML that ships
with aimnet (`aimnet/models/aimnet2_dftd3_wb97m.yaml`, the architecture of the released
wB97M-D3 AIMNet2) and converted to the released (v2) layout the way aimnet's own
export does it (`strip_lr_modules_from_yaml`): the all-pairs Coulomb and DFT-D3 leave
the network, a short-range Coulomb subtraction (`SRCoulomb`) stays inside, and the
metadata says what a calculator adds outside (``needs_coulomb``, ``needs_dispersion``).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

# The elements of the released AIMNet2 (wB97M-D3): H, B, C, N, O, F, Si, P, S, Cl, As, Se, Br, I.
RELEASED_SPECIES = (1, 5, 6, 7, 8, 9, 14, 15, 16, 17, 33, 34, 35, 53)


@functools.cache
def _package_config(name: str) -> dict:
    import aimnet
    import yaml

    path = Path(aimnet.__file__).parent / "models" / name
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def released_layout(config_name: str = "aimnet2_dftd3_wb97m.yaml") -> tuple[dict, dict]:
    """(model config, metadata) of the released layout, from one of aimnet's configs."""
    from aimnet.models.utils import strip_lr_modules_from_yaml

    core, coulomb_mode, needs_dispersion, d3_params, sr_rc, envelope, _ = strip_lr_modules_from_yaml(
        _package_config(config_name), {}
    )
    rc_s = float(core["kwargs"]["aev"]["rc_s"])
    metadata = {
        "format_version": 2,
        "cutoff": rc_s,
        "needs_coulomb": coulomb_mode == "sr_embedded",
        "needs_dispersion": bool(needs_dispersion),
        "coulomb_mode": coulomb_mode,
        "coulomb_sr_rc": sr_rc,
        "coulomb_sr_envelope": envelope,
        "d3_params": d3_params,
        "has_embedded_lr": coulomb_mode == "sr_embedded",
        "implemented_species": list(RELEASED_SPECIES),
    }
    return core, metadata


def to_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """``model`` in ``dtype``, its atomic energy shifts kept in float64 (as aimnet's loader keeps them).

    A shift is a large per-element constant (about -2000 eV for oxygen in a released
    model); in float32 its rounding alone moves a 300-atom energy by ~0.1 eV, a thousand
    times aimnet's own float32 error. The per-atom energies are promoted to float64 where
    the shifts are added, and summed per system in float64.
    """
    from aimnet.modules import AtomicShift

    # the values, not only the dtype: a float64 -> float32 -> float64 round trip rounds them
    shifts = {m: copy.deepcopy(m.state_dict()) for m in model.modules() if isinstance(m, AtomicShift)}
    if dtype is not None:
        model = model.to(dtype)
    for module, state in shifts.items():
        module.double().load_state_dict({k: v.double() for k, v in state.items()})
    return model


def random_aimnet2(seed: int = 0, dtype: torch.dtype = torch.float64,
                   config_name: str = "aimnet2_dftd3_wb97m.yaml"):
    """(model, metadata): aimnet's `AIMNet2` in the released layout with seeded random weights.

    The global RNG is left as it was (aimnet's constructors draw from it).
    """
    from aimnet.config import build_module

    config, metadata = released_layout(config_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_module(copy.deepcopy(config))
    model = to_dtype(model, dtype).eval()
    model.requires_grad_(False)
    model.__dict__["_metadata"] = copy.deepcopy(metadata)  # where aimnet's loader puts it
    return model, metadata


def save_checkpoint(model: torch.nn.Module, metadata: dict, path: str | Path,
                    config_name: str = "aimnet2_dftd3_wb97m.yaml") -> None:
    """Write ``model`` as an aimnet v2 ``.pt`` file (what aimnet's loader reads)."""
    import yaml

    config, _ = released_layout(config_name)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    torch.save({**metadata, "model_yaml": yaml.dump(config, sort_keys=False), "state_dict": state}, str(path))

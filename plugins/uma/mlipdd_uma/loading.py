"""Loading UMA models through fairchem's own loaders (checkpoint files, released names).

Both go through fairchem's predict-unit loader, which applies its checkpoint
compatibility fix-ups, the EMA weights and the task setup (normalizers, element
references); the wrapper then calls the unit's Hydra model directly. The inference
settings are pinned to what mlipdd's adapters are written for: float32, no
compilation, no MoLE merge (merging fixes one composition, and a subdomain's changes),
no activation checkpointing, the plain PyTorch execution backend, graph built inside
the model.
"""

from __future__ import annotations

from pathlib import Path

from mlipdd_uma.versions import require_fairchem


def inference_settings():
    """fairchem `InferenceSettings` for mlipdd (see the module docstring)."""
    import torch
    from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

    return InferenceSettings(
        tf32=False,
        activation_checkpointing=False,
        merge_mole=False,
        compile=False,
        external_graph_gen=False,
        internal_graph_gen_version=2,
        base_precision_dtype=torch.float32,
        nitro=False,
        execution_mode="general",
    )


def _model_of(unit):
    """The Hydra model inside a predict unit, ready for inference in float32."""
    model = unit.model.module if hasattr(unit.model, "module") else unit.model
    model.requires_grad_(False)
    return model.float().eval()


def load_checkpoint(path: str | Path, device: str = "cpu"):
    """A fairchem inference checkpoint file -> its Hydra model (with tasks)."""
    require_fairchem()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no UMA checkpoint at {str(path)!r}; give the path of a fairchem inference checkpoint "
            "(.pt), or load a released model by name with UMAWrapper.from_pretrained('uma-s-1p1')"
        )
    from fairchem.core.units.mlip_unit import load_predict_unit

    unit = load_predict_unit(str(path), inference_settings=inference_settings(), device=device)
    return _model_of(unit).to(device)


def load_pretrained(name: str, device: str = "cpu"):
    """A released UMA model by name, downloaded (once, then cached) by fairchem."""
    require_fairchem()
    from fairchem.core.calculate import pretrained_mlip

    known = list(getattr(pretrained_mlip, "available_models", []))
    if known and name not in known:
        raise ValueError(f"unknown UMA model name {name!r}; fairchem knows {sorted(known)}")
    try:
        unit = pretrained_mlip.get_predict_unit(name, inference_settings=inference_settings(), device=device)
    except Exception as exc:
        raise RuntimeError(
            f"could not fetch the UMA model {name!r} through fairchem's pretrained loader "
            f"({type(exc).__name__}: {exc}). The weights come from Hugging Face (facebook/UMA, a "
            "gated repository): on a machine with network access accept the licence, run "
            "`huggingface-cli login`, and retry; offline, copy the checkpoint file here and use "
            "UMAWrapper.from_checkpoint(path)"
        ) from exc
    return _model_of(unit).to(device)

"""Loading AIMNet2 models through aimnet's own loaders (model files, registry names)."""

from __future__ import annotations

from pathlib import Path

from mlipdd_aimnet2.versions import require_aimnet


def load_file(path: str | Path, device: str = "cpu"):
    """(model, metadata) from an aimnet v2 ``.pt`` file, via `aimnet.models.base.load_model`.

    aimnet reads v2 files with ``torch.load(weights_only=True)`` and builds the model from
    the file's YAML under its import allow-list. Legacy TorchScript ``.jpt`` files are not
    accepted: convert them with ``aimnet convert`` first.
    """
    require_aimnet()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no AIMNet2 model file at {str(path)!r}; give the path of an aimnet v2 .pt file, or load a "
            "released model by name with AIMNet2Wrapper.from_name('aimnet2')"
        )
    if path.suffix.lower() == ".jpt":
        raise ValueError(
            f"{str(path)!r} is a legacy TorchScript AIMNet2 file; convert it to the v2 format with "
            "`aimnet convert model.jpt config.yaml model.pt` and load the .pt file"
        )
    from aimnet.models.base import load_model

    model, metadata = load_model(str(path), device=device)
    return model.eval(), dict(metadata)


def load_named(name: str, device: str = "cpu"):
    """(model, metadata) for a registry name ("aimnet2", "aimnet2-wb97m-d3_0", ...), downloaded
    once and cached by aimnet (needs network access)."""
    require_aimnet()
    from aimnet.calculators.model_registry import get_model_path

    try:
        path = get_model_path(name)
    except Exception as exc:
        raise RuntimeError(
            f"could not fetch the AIMNet2 model {name!r} through aimnet's registry ({type(exc).__name__}: "
            f"{exc}); on a machine with network access retry, offline copy the .pt file here and use "
            "AIMNet2Wrapper.from_file(path)"
        ) from exc
    from aimnet.models.base import load_registry_model

    model, metadata = load_registry_model(str(path), device=device)
    return model.eval(), dict(metadata)

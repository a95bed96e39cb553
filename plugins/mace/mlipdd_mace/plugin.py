"""mlipdd hook implementations for MACE (entry point ``mlipdd: mace``).

Importing this module must stay cheap and must not import mace: the plugin manager
loads every plugin at start-up, and mace (with e3nn) takes seconds to import.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mlipdd import hookimpl


def make_mace_model(
    model=None,
    *,
    path: str | Path | None = None,
    foundation: str | None = None,
    head: str | None = None,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    cueq: bool = False,
    conv_fusion: bool | None = None,
    chunk_atoms: int | None = None,
):
    """Factory for model name ``"mace"``: exactly one of a model object, ``path=`` or ``foundation=``.

    ``cueq=True`` converts to cuEquivariance on ``device`` (``mlipdd run --device cuda
    --model-arg cueq=true``), ``chunk_atoms`` evaluates a few thousand atoms at a time.
    """
    from mlipdd_mace.wrapper import MACEWrapper

    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    options = {"head": head, "dtype": dtype, "cueq": cueq, "conv_fusion": conv_fusion, "chunk_atoms": chunk_atoms}

    given = [
        name
        for name, value in (("model", model), ("path", path), ("foundation", foundation))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "the 'mace' model needs exactly one of: a mace model object, path='file.model' or "
            f"foundation='medium-mpa-0' (got {', '.join(given) or 'none'})"
        )
    if path is not None:
        wrapper = MACEWrapper.from_file(path, device=device, **options)
    elif foundation is not None:
        wrapper = MACEWrapper.from_foundation(foundation, device=device, **options)
    elif isinstance(model, (str, Path)):
        raise TypeError(
            f"got the string {str(model)!r} as a model; pass path= for a file or foundation= for a name"
        )
    else:
        model = model.to(device) if dtype is None else model.to(device=device, dtype=dtype)
        wrapper = MACEWrapper(model, head=head, cueq=cueq, conv_fusion=conv_fusion, chunk_atoms=chunk_atoms)
    return wrapper


@hookimpl
def mlipdd_register_models(register):
    register(
        "mace",
        make_mace_model,
        description="MACE / ScaleShiftMACE (mace-torch): path=, foundation= or a model object",
    )


@hookimpl
def mlipdd_register_presets(register):
    from mlipdd.spec import SPEC_MPNN_HALO

    # MACE is a plain halo message-passing network; the alias names it for users.
    register("SPEC_MACE_HALO", SPEC_MPNN_HALO)


@hookimpl
def mlipdd_wrap_model(model, options):
    """Wrap a raw mace model; ``None`` for anything else so other plugins get a turn."""
    from mlipdd_mace.wrapper import MACEWrapper, is_mace_model

    if not is_mace_model(model):
        return None
    options = options or {}
    # nn.Module.to converts in place: the user's model object follows these options.
    if options.get("device") is not None:
        model = model.to(options["device"])
    if options.get("dtype") is not None:
        model = model.to(options["dtype"])
    return MACEWrapper(model, head=options.get("head"))

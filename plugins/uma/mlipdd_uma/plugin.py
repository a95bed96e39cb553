"""mlipdd hook implementations for UMA (entry point ``mlipdd: uma``).

Importing this module stays cheap and does not import fairchem (seconds to import):
the plugin manager loads every plugin at start-up. Specs and models are built on use.
"""

from __future__ import annotations

from pathlib import Path

from mlipdd import hookimpl


def make_uma_model(model=None, *, path: str | Path | None = None, pretrained: str | None = None,
                   task: str | None = None, charge: int = 0, spin: int | None = None,
                   device: str = "cpu"):
    """Factory for model name ``"uma"``: exactly one of a model object, ``path=`` or ``pretrained=``."""
    from mlipdd_uma.wrapper import UMAWrapper

    given = [n for n, v in (("model", model), ("path", path), ("pretrained", pretrained)) if v is not None]
    if len(given) != 1:
        raise ValueError(
            "the 'uma' model needs exactly one of: a fairchem UMA model object, path='checkpoint.pt' "
            f"or pretrained='uma-s-1p1' (got {', '.join(given) or 'none'})"
        )
    options = {"task": task, "charge": charge, "spin": spin}
    if path is not None:
        return UMAWrapper.from_checkpoint(path, device=device, **options)
    if pretrained is not None:
        return UMAWrapper.from_pretrained(pretrained, device=device, **options)
    if isinstance(model, (str, Path)):
        raise TypeError(f"got the string {str(model)!r} as a model; pass path= for a file or pretrained= for a name")
    return UMAWrapper(model.to(device), **options)


@hookimpl
def mlipdd_register_models(register) -> None:
    register("uma", make_uma_model,
             description="UMA / eSCN-MD (fairchem-core): path=, pretrained= or a model object; task=")


@hookimpl
def mlipdd_register_presets(register) -> None:
    from mlipdd_uma.spec import uma_halo_spec

    register("SPEC_UMA_HALO", uma_halo_spec())


@hookimpl
def mlipdd_register_spec_modules(register) -> None:
    """What a saved UMA spec file names: the replacements (ours, in full) and the modules
    they patch (targets only), so SPEC_UMA_HALO and the graph-partition spec load again."""
    register("mlipdd_uma.halo")
    register("mlipdd_uma.graph_partition")
    register("mlipdd_uma.wrapper", patch_only=True)
    for module in ("escn_md", "escn_md_block", "outputs"):
        register(f"fairchem.core.models.uma.{module}", patch_only=True)


@hookimpl
def mlipdd_wrap_model(model, options):
    """Wrap a raw fairchem UMA model; ``None`` for anything else so other plugins get a turn."""
    from mlipdd_uma.wrapper import UMAWrapper, is_uma_model

    if not is_uma_model(model):
        return None
    options = dict(options or {})
    if options.get("device") is not None:
        model = model.to(options["device"])
    dtype = options.get("dtype")
    if dtype is not None and dtype != __import__("torch").float32:
        raise TypeError(f"UMA runs in float32 only; wrap it without dtype={dtype} (or dtype=torch.float32)")
    return UMAWrapper(model, task=options.get("task"), charge=options.get("charge", 0), spin=options.get("spin"))

"""mlipdd hook implementations for AIMNet2 (entry point ``mlipdd: aimnet2``).

Importing this module stays cheap and does not import aimnet (which imports warp and
nvalchemiops): the plugin manager loads every plugin at start-up.
"""

from __future__ import annotations

from pathlib import Path

from mlipdd import hookimpl


def make_aimnet2_model(model=None, *, path: str | Path | None = None, name: str | None = None,
                       device: str = "cpu", dtype=None, **options):
    """Factory for model name ``"aimnet2"``: exactly one of a model object, ``path=`` or ``name=``.

    ``options`` go to `AIMNet2Wrapper` (``coulomb``, ``dsf_cutoff``, ``charge``, ``dispersion``, ...).
    """
    from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

    given = [n for n, v in (("model", model), ("path", path), ("name", name)) if v is not None]
    if len(given) != 1:
        raise ValueError(
            "the 'aimnet2' model needs exactly one of: an aimnet AIMNet2 model object, path='model.pt' "
            f"or name='aimnet2' (got {', '.join(given) or 'none'})"
        )
    if path is not None:
        return AIMNet2Wrapper.from_file(path, device=device, dtype=dtype, **options)
    if name is not None:
        return AIMNet2Wrapper.from_name(name, device=device, dtype=dtype, **options)
    if isinstance(model, (str, Path)):
        raise TypeError(f"got the string {str(model)!r} as a model; pass path= for a file or name= for a registry name")
    from mlipdd_aimnet2.building import to_dtype

    return AIMNet2Wrapper(to_dtype(model.to(device), dtype), **options)


@hookimpl
def mlipdd_register_models(register) -> None:
    register("aimnet2", make_aimnet2_model,
             description="AIMNet2 (aimnet): path=, name= or a model object; coulomb='dsf'|'simple'|'none' "
                         "or {'molecule': ..., 'periodic': ...}")


@hookimpl
def mlipdd_register_presets(register) -> None:
    from mlipdd_aimnet2.spec import aimnet2_halo_spec, aimnet2_sharded_spec

    register("SPEC_AIMNET2_SHARDED", aimnet2_sharded_spec())
    register("SPEC_AIMNET2_HALO", aimnet2_halo_spec())


@hookimpl
def mlipdd_register_spec_modules(register) -> None:
    """What a saved SPEC_AIMNET2_* file names: the replacements (ours, in full) and the
    aimnet modules they patch (targets only), so the presets save and load again."""
    register("mlipdd_aimnet2.adapters")
    register("aimnet.nbops", patch_only=True)
    register("aimnet.modules.aev", patch_only=True)


@hookimpl
def mlipdd_wrap_model(model, options):
    """Wrap a raw aimnet `AIMNet2`; ``None`` for anything else so other plugins get a turn."""
    from mlipdd_aimnet2.wrapper import is_aimnet2_model

    if not is_aimnet2_model(model):
        return None
    options = dict(options or {})
    device, dtype = options.pop("device", None), options.pop("dtype", None)
    if device is not None:
        model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

    return AIMNet2Wrapper(model, **options)

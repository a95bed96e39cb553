"""Hook implementations of the Ewald / PME plugin (entry point ``ewald_pme``).

Importing this module stays cheap: the wrappers (and Warp, through nvalchemiops) are
imported inside the factories.
"""

from __future__ import annotations

from mlipdd import hookimpl
from mlipdd.hookspecs import RegisterModel, RegisterPreset, RegisterSpecModule


def make_ewald(**options):
    from mlipdd_ewald_pme.wrappers import EwaldWrapper

    return EwaldWrapper(**options)


def make_pme(**options):
    from mlipdd_ewald_pme.wrappers import PMEWrapper

    return PMEWrapper(**options)


def make_dsf(**options):
    from mlipdd_ewald_pme.wrappers import DSFWrapper

    return DSFWrapper(**options)


NACL_CHARGES = {"Na": 1.0, "Cl": -1.0}


def make_molten_salt(cutoff: float = 7.0, accuracy: float = 1e-6, **pme_options):
    """Born-Mayer (Tosi-Fumi NaCl) + PME with formal charges Na +1, Cl -1."""
    from mlipdd.models import PipelineModelWrapper

    from mlipdd_ewald_pme.born_mayer import BornMayerWrapper
    from mlipdd_ewald_pme.wrappers import PMEWrapper

    pme_options.setdefault("element_charges", NACL_CHARGES)
    return PipelineModelWrapper([BornMayerWrapper(cutoff=cutoff),
                                 PMEWrapper(cutoff=cutoff, accuracy=accuracy, **pme_options)])


def make_d3(**options):
    from mlipdd_ewald_pme.d3 import D3Wrapper

    return D3Wrapper(**options)


@hookimpl
def mlipdd_register_models(register: RegisterModel) -> None:
    register("ewald", make_ewald, description="Ewald summation of per-atom charges (cutoff=, accuracy=, alpha=)")
    register("pme", make_pme, description="particle-mesh Ewald (cutoff=, accuracy=, mesh_spacing=, spline_order=)")
    register("molten_salt", make_molten_salt,
             description="NaCl melt: Born-Mayer (Tosi-Fumi) + PME, charges Na +1 / Cl -1 (cutoff=, accuracy=)")
    register("d3", make_d3, description="DFT-D3(BJ) two-body dispersion, Grimme reference C6 (cutoff=, params=)")
    register("dsf", make_dsf, description="damped shifted force Coulomb, periodic or open (cutoff=, alpha=)")


@hookimpl
def mlipdd_register_presets(register: RegisterPreset) -> None:
    from mlipdd_ewald_pme.spec import PRESETS

    for name, spec in PRESETS.items():
        register(name, spec)


@hookimpl
def mlipdd_register_spec_modules(register: RegisterSpecModule) -> None:
    register("mlipdd_ewald_pme.spec")


@hookimpl
def mlipdd_wrap_model(model: object, options: dict) -> None:
    """The wrappers are built directly; no upstream model object to recognise."""
    return

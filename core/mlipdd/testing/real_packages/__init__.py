"""Real third-party MLIP packages' models, wrapped as ordinary mlipdd models.

Each entry builds one package's model from that package's own configuration with
random weights (seeded: the same on every rank), written the way the package's users
build it, and wraps it as a plain `ModelWrapper` (forward = single-process code). They
are the outside check of the first rule: under `DistributedModel` each case either
equals one process or is refused by name (`classify`, `docs/real_packages.md`).

The packages are in the root ``test`` extra; a model whose package is missing is
reported as such by `available`, never silently skipped by the runner.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RealModel:
    package: str  # the distribution to install (and import name, below)
    module: str  # the import that must succeed
    factory: Callable  # module-level (the spawned ranks rebuild it), returns a ModelWrapper
    what: str  # one line for the table


from mlipdd.testing.real_packages import (
    matgl_models,
    nequip_models,
    orb_models,
    schnetpack_models,
    sevenn_models,
)

REAL_MODELS: dict[str, RealModel] = {
    "schnetpack SchNet": RealModel("schnetpack", "schnetpack", schnetpack_models.schnet,
                                   "NeuralNetworkPotential(SchNet), Strain + PairwiseDistances, Atomwise, Forces"),
    "schnetpack PaiNN": RealModel("schnetpack", "schnetpack", schnetpack_models.painn,
                                  "NeuralNetworkPotential(PaiNN), Strain + PairwiseDistances, Atomwise, Forces"),
    "orb-v3 conservative": RealModel("orb-models", "orb_models.forcefield.pretrained", orb_models.conservative,
                                     "orb_v3_conservative_architecture (small), AtomGraphs, ZBL, forces/stress by autograd"),
    "orb-v3 direct": RealModel("orb-models", "orb_models.forcefield.pretrained", orb_models.direct,
                               "orb_v3_direct_architecture (small), AtomGraphs, ZBL, force and stress heads"),
    "sevenn SevenNet": RealModel("sevenn", "sevenn.model_build", sevenn_models.sevennet,
                                 "build_E3_equivariant_model (small), ForceStressOutputFromEdge (forces from edge gradients)"),
    "matgl TensorNet": RealModel("matgl", "matgl.apps.pes", matgl_models.tensornet,
                                 "Potential(TensorNet) (small), PyG graph of fractional coordinates, forces/stress by autograd"),
    # not in the test extra (torchmetrics, see __main__.NOT_INSTALLABLE): classified where installed
    "nequip NequIP": RealModel("nequip", "nequip.model", nequip_models.nequip,
                               "NequIPGNNModel (small), AtomicDataDict, forces/stress by autograd"),
}


def available(name: str) -> str | None:
    """``None`` when ``name``'s package imports, else why not (for the table and a skip)."""
    try:
        if REAL_MODELS[name].package == "schnetpack":
            schnetpack_models._import_schnetpack()
        else:
            importlib.import_module(REAL_MODELS[name].module)
    except ImportError as exc:
        return f"{REAL_MODELS[name].package} not installed ({exc})"
    return None

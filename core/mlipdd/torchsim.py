"""torch-sim adapter: `TorchSimModel` lets torch-sim's integrators and optimisers drive any
mlipdd model (needs ``pip install 'mlipdd[torchsim]'``, i.e. torch-sim-atomistic).

torch-sim 0.4 and later (0.6 is the current release; Python >= 3.12):

    import torch_sim as ts
    from ase.build import bulk
    from mlipdd.models import LennardJones
    from mlipdd.torchsim import TorchSimModel

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
    model = TorchSimModel(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5))  # nproc=2: DD
    state = ts.initialize_state(atoms, device=model.device, dtype=model.dtype)
    final = ts.integrate(system=state, model=model, integrator=ts.Integrator.nvt_langevin,
                         n_steps=20, temperature=60.0, timestep=0.004)
    relaxed = ts.optimize(system=state, model=model, optimizer=ts.Optimizer.fire, max_steps=50,
                          init_kwargs={"cell_filter": ts.CellFilter.unit})

torch-sim 0.3 (the newest release that installs on Python 3.11, what pip resolves there;
0.4 and later use Python 3.12 syntax) has plain functions instead of the enums; the rest
is the same:

    final = ts.integrate(system=state, model=model, integrator=ts.nvt_langevin,
                         n_steps=20, temperature=60.0, timestep=0.004)
    relaxed = ts.optimize(system=state, model=model, optimizer=ts.unit_cell_fire, max_steps=50)

The adapter is the same for both: it only implements ``ModelInterface.forward(state)``.

Domain decomposition: with ``nproc=N`` every force call runs on N persistent ranks (the
same machinery as `mlipdd.ase.MLIPDDCalculator`); torch-sim's state and integrator stay in
this process, so the full system is sent to the ranks and the forces gathered back each
step. That splits the model's cost (the part that dominates for an MLIP), not the
integrator's. Running torch-sim itself on every rank with sharded state is not supported.
"""
from __future__ import annotations

import torch

try:
    from torch_sim.models.interface import ModelInterface
except ModuleNotFoundError as missing:
    if not (missing.name or "").startswith("torch_sim"):
        raise  # torch-sim is there but one of its own dependencies is not: show that
    # `from None`: the user needs the install line, not the chain of import frames
    raise ImportError(
        "mlipdd.torchsim needs torch-sim (torch-sim-atomistic): pip install 'mlipdd[torchsim]'"
    ) from None

from mlipdd.data import Batch, InputError
from mlipdd.distributed.rank_pool import ModelEvaluator


class TorchSimModel(ModelInterface):
    """A torch-sim `ModelInterface` over an mlipdd model wrapper (or a raw MACE/UMA model).

    Returns ``energy`` (n_systems,), ``forces`` (n_atoms, 3), ``stress`` (n_systems, 3, 3)
    in eV, eV/A and eV/A^3 with torch-sim's (and ASE's) sign, plus any other per-atom
    output the model gives (``charges``).
    """

    def __init__(self, model, *, nproc: int = 1, config=None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, compute_stress: bool = True):
        super().__init__()
        self.evaluator = ModelEvaluator(model, nproc, config, str(device) if device else None, dtype)
        self._device = self.evaluator.device
        self._dtype = self.evaluator.dtype
        self._compute_stress = bool(compute_stress)
        self._compute_forces = True
        self._memory_scales_with = "n_atoms_x_density"  # radial cutoff models

    def forward(self, state, **kwargs) -> dict[str, torch.Tensor]:
        batch = batch_from_state(state, self._dtype)
        periodic = bool(batch.pbc.all())
        out = self.evaluator.evaluate(batch, compute_stress=self._compute_stress and periodic)
        return {k: v.to(device=self._device) for k, v in out.items()}

    def close(self) -> None:
        """Stop the ranks of ``nproc > 1`` (atexit does it otherwise)."""
        self.evaluator.close()


def batch_from_state(state, dtype: torch.dtype) -> Batch:
    """A torch-sim `SimState` (or its dict form) as an mlipdd `Batch` (row-vector cell)."""
    get = state.get if isinstance(state, dict) else lambda k, d=None: getattr(state, k, d)
    positions = get("positions")
    system_idx = get("system_idx")
    if system_idx is None:
        system_idx = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
    if system_idx.numel() and (system_idx.diff() < 0).any():
        raise InputError("torch-sim state: atoms must be ordered by system_idx (as SimState keeps them)")
    n_systems = int(system_idx.max()) + 1 if system_idx.numel() else 0
    cell = get("cell")
    cell = cell.reshape(-1, 3, 3).mT  # torch-sim keeps cell vectors as columns, mlipdd as rows
    pbc = torch.as_tensor(get("pbc", True), dtype=torch.bool, device=positions.device)
    pbc = pbc.expand(n_systems, 3) if pbc.dim() < 2 else pbc
    node = {
        "positions": positions.detach().to(dtype),
        "atomic_numbers": get("atomic_numbers").to(torch.long),
        "atomic_masses": get("masses").detach().to(dtype),
        "batch": system_idx.to(torch.long),
    }
    system = {"cell": cell.detach().to(dtype), "pbc": pbc.clone()}
    for name in ("charge", "spin"):
        value = get(name)
        if torch.is_tensor(value):
            system[name] = value.detach().to(dtype).reshape(n_systems)
    return Batch(node, system)

"""`CompiledForceCall`: a model's force call through ``torch.compile`` at fixed, padded shapes.

Why padded: ``torch.compile`` specialises a graph to the shapes it saw; the atoms of a
rank and the edges of its list change at every neighbour-list rebuild, so an unpadded
call would recompile at each one. Here every call runs at *caps*: a number of atom rows
and edge slots fixed until the system outgrows them (then larger caps, one recompile,
never a crash). Caps start at ``headroom`` times the first call's sizes.

# NOTE [padding rows]
The rows past the real atoms are *padding atoms* in a padding system of their own (one
more entry in every per-system field, a cubic cell ``reach + 1`` wide, periodic); the
edge slots past the real edges are *null edges*: a padding atom joined to its own image
one cell vector away, ``reach + 1`` long. So nothing padded touches a real atom: a real
atom's energy, force and stress see exactly the edges they see eagerly, the padding
system's energy and stress are dropped, and the null edges weigh zero in every model
(a Verlet list's skin edges already demand that; see NOTE [null edges] in
`mlipdd.distributed.cuda_graph`). The list is marked ``padded`` so a model keeps every
slot instead of filtering (which would change the shapes).

# NOTE [compiled equals eager]
The first rule binds a compiled path too: the first call at every new set of shapes,
and every call that brings an element not yet checked (NOTE [checked elements]), is also
run eagerly on the unpadded batch and compared (float64: 1e-9 of the largest value,
float32: 1e-3). A difference stops the run naming the output and the fix (compile=False).
Dynamo does not fall back to eager silently either: hitting its recompile limit raises,
and a new set of shapes that reached no graph is refused.

# NOTE [checked elements]
Inside the compiled region `mlipdd.models.capturing` is true, so wrappers skip their
host-side input checks there (they would break the graph); the checks run in the eager
comparison call of the same inputs. What they check is the elements (an atomic number the
model has no parameters for), and integer inputs are not in dynamo's guards, so a call
whose atomic numbers hold an element no eager call has seen yet is checked again. A
permutation or migration of the same elements is not (at several ranks atoms migrate at
every rebuild): the compiled graph reads them as tensors, as the eager call does.
"""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlipdd.data import Batch, InputError
from mlipdd.distributed.compiled_sums import OWNED_ROWS
from mlipdd.neighbors import NeighborList

__all__ = ["Caps", "CompiledForceCall", "pad_to_caps", "unpad_outputs"]

ForceCall = Callable[[Batch, bool], dict]
PER_SYSTEM = frozenset({"energy", "stress", "virial"})
# outputs an integrator keeps in the batch: no model reads them, and a field that comes
# and goes would change the compiled call's inputs (a recompile)
OUTPUT_FIELDS = frozenset({"energy", "stress", "virial", "forces", "energies"})
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3}
RECOMPILE_LIMIT = 64  # graphs one CompiledForceCall may build; hitting it raises (fail_on_recompile_limit_hit)


@dataclass(frozen=True)
class Caps:
    """Rows of the padded call: ``atoms`` (real + at least one padding atom) and ``edges``."""

    atoms: int
    edges: int

    def fit(self, atoms: int, edges: int) -> bool:
        return atoms < self.atoms and edges <= self.edges

    @staticmethod
    def around(atoms: int, edges: int, headroom: float, systems: int) -> Caps:
        n = max(math.ceil(headroom * atoms), atoms + 1)
        if n == systems + 1:  # per-atom and per-system outputs must not have the same rows
            n += 1
        return Caps(n, max(math.ceil(headroom * edges), edges + 16))


class CompileCounts:
    """The one compiled function of a compiled call (NOTE [one cache per call]) and what it
    counts: ``compiles`` (calls that compiled a graph), ``recompiles`` (those after the
    first), ``graphs`` (graphs the backend compiled, graph breaks included), ``checks``
    (eager comparisons), ``compile_seconds`` (wall time of the calls that compiled)."""

    def __init__(self, backend: str, dynamic: bool | None):
        self.backend = backend
        self.compiles = 0
        self.graphs = 0
        self.checks = 0
        self.compile_seconds = 0.0
        self._keys: set = set()
        # NOTE [one cache per call]: dynamo keeps compiled graphs, and counts recompiles
        # against its limit, per code object; a fresh copy of the function gives every
        # compiled call its own (a process that builds many models never hits the limit
        # through the others' graphs, and the graphs go with their compiled call)
        self._compiled = torch.compile(_fresh_copy(_padded_call), backend=self._counting_backend, dynamic=dynamic)

    @property
    def recompiles(self) -> int:
        return max(self.compiles - 1, 0)

    def _counting_backend(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

    def _run_compiled(self, model_call: ForceCall, batch: Batch, compute_stress: bool) -> tuple[dict, bool]:
        """``(outputs, whether a new graph was compiled)`` of the compiled call. Always under
        no_grad: the grad mode is part of dynamo's guards (an integrator calls under no_grad,
        a user's script with grad on), and the force call enables grad for its own backward
        anyway. Outputs are detached: compiled calls are not for training."""
        graphs_before, start = self.graphs, time.perf_counter()
        with torch._dynamo.config.patch(trace_autograd_ops=True, recompile_limit=RECOMPILE_LIMIT,
                                        fail_on_recompile_limit_hit=True), torch.no_grad():
            outputs = self._compiled(model_call, batch, compute_stress)
        if self.graphs == 0:
            raise RuntimeError(
                "DomainConfig(compile=True): torch.compile produced no graph (it ran the force call "
                "eagerly, e.g. under torch._dynamo.disable); run with compile=False or call the "
                "model outside what disables dynamo"
            )
        compiled_now = self.graphs > graphs_before
        if compiled_now:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
        return outputs, compiled_now


class CompiledForceCall(CompileCounts):
    """``call(batch, compute_stress) -> outputs`` compiled with ``torch.compile`` at caps.

    ``model_call`` is what gets compiled (the wrapper's forward, no context managers);
    ``eager_call`` is the full eager path the first call at each shape is checked against
    (NOTE [compiled equals eager]). ``reach``: the radius the list was built with (null
    edges are longer). ``backend``: a ``torch.compile`` backend (``"inductor"``; the
    cheaper ``"aot_eager"`` traces the same graphs without generating code). Counters:
    `CompileCounts` (a compile: new caps, the other stress flag).
    """

    def __init__(self, model_call: ForceCall, eager_call: ForceCall, reach: float, backend: str = "inductor",
                 headroom: float = 1.2, check_eager: bool = True):
        if not headroom >= 1.0:
            raise InputError(f"headroom must be >= 1 (caps / sizes at the first call), got {headroom}")
        super().__init__(backend, dynamic=False)
        self.model_call = model_call
        self.eager_call = eager_call
        self.reach = float(reach)
        self.headroom = float(headroom)
        self.check_eager = bool(check_eager)
        self.caps: Caps | None = None
        self.needs_check = False
        self._counts: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._numbers_seen: tuple[torch.Tensor, int] | None = None
        self._elements_checked: set[int] = set()

    def __call__(self, batch: Batch, compute_stress: bool = False) -> dict:
        _check_compilable(batch)
        compute_stress = bool(compute_stress)
        atoms, edges = batch.num_atoms, batch.neighbors.num_edges
        if self.caps is None or not self.caps.fit(atoms, edges):
            grown = Caps.around(atoms, edges, self.headroom, batch.num_systems)
            if self.caps is not None:  # never shrink: a recompile costs far more than the rows
                grown = Caps(max(grown.atoms, self.caps.atoms), max(grown.edges, self.caps.edges))
            self.caps = grown
        padded = pad_to_caps(batch, self.caps, self.reach, counts=self._atoms_per_system(batch))
        key = _shape_key(padded, compute_stress)
        new_shapes = key not in self._keys
        # new shapes that reach no new graph passed the guards of an old one (they differ in
        # a field the model does not read): that graph is valid for them, and checked below
        outputs, compiled_now = self._run_compiled(self.model_call, padded, compute_stress)
        self._keys.add(key)
        result = unpad_outputs(outputs, self.caps.atoms, atoms, batch.num_systems)
        structure_changed = self._structure_changed(batch)  # always: it also remembers what it saw
        # read by a caller that checks itself (several ranks agree first: compiled_halo)
        self.needs_check = new_shapes or compiled_now or structure_changed
        if self.check_eager and self.needs_check:
            self._compare_with_eager(batch, compute_stress, result)
        return result

    def _atoms_per_system(self, batch: Batch) -> torch.Tensor:
        """Counted (a ``bincount``: a host sync on CUDA) only when the system index changes."""
        index = batch.batch
        seen = self._counts
        if seen is None or seen[0] is not index or seen[1] != index._version:
            self._counts = seen = (index, index._version, batch.atoms_per_system)
        return seen[2]

    def _structure_changed(self, batch: Batch) -> bool:
        """Whether the batch holds an element not yet checked eagerly (NOTE [checked elements]).
        A device read only when the atomic numbers are a new tensor or were modified in place
        (at a rebuild), never in the steady state."""
        numbers = batch.atomic_numbers
        seen = self._numbers_seen
        if numbers is None or (seen is not None and seen[0] is numbers and seen[1] == numbers._version):
            return False
        self._numbers_seen = (numbers, numbers._version)
        present = set(torch.unique(numbers).tolist())
        if present <= self._elements_checked:
            return False
        self._elements_checked |= present
        return True

    def _compare_with_eager(self, batch: Batch, compute_stress: bool, result: dict) -> None:
        self.checks += 1
        error = differs_from_eager(result, self.eager_call(batch, compute_stress), self.caps)
        if error is not None:
            raise error


def differs_from_eager(result: dict, eager: dict, caps) -> RuntimeError | None:
    """The error to raise when a compiled output is not the eager one (NOTE [compiled equals
    eager]), else None."""
    for name, want in eager.items():
        got = result.get(name)
        if not torch.is_tensor(want) or got is None:
            continue
        want = want.detach()
        if got.shape != want.shape:
            diff, tol = float("inf"), 0.0
        elif want.numel() == 0:
            continue
        else:
            tol = TOLERANCE.get(want.dtype, 1e-3) * max(float(want.abs().max()), 1.0)
            diff = float((got - want).abs().max())
        if not diff <= tol:
            return RuntimeError(
                f"DomainConfig(compile=True): the compiled {name} differs from the eager one by "
                f"{diff:.3g} (allowed {tol:.3g}, caps {caps}); the model's code behaves differently "
                "compiled (a branch on torch.compiler.is_compiling(), a host-side value baked into the "
                "graph; at several ranks: a model whose atoms' energies read more than their own "
                "neighbours, see mlipdd.distributed.compiled_halo). Run with compile=False"
            )
    return None


def _padded_call(model_call: ForceCall, batch: Batch, compute_stress: bool) -> dict:
    """What is compiled: the force call on a padded batch, its outputs detached (a returned
    tensor whose graph ``autograd.grad`` consumed would break the graph)."""
    out = model_call(batch, compute_stress)
    return {name: value.detach() if torch.is_tensor(value) else value for name, value in out.items()}


def _fresh_copy(fn):
    """``fn`` with a code object of its own (NOTE [one cache per call])."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def pad_to_caps(batch: Batch, caps: Caps, reach: float, counts: torch.Tensor | None = None) -> Batch:
    """``batch`` padded to ``caps`` rows (NOTE [padding rows]); positions a fresh leaf.
    ``counts``: the batch's atoms per system, when known."""
    atoms, systems = batch.num_atoms, batch.num_systems
    extra = caps.atoms - atoms
    if extra < 1 or batch.neighbors.num_edges > caps.edges:
        raise InputError(f"{atoms} atoms and {batch.neighbors.num_edges} edges do not fit caps {caps}")
    device, dtype = batch.device, batch.dtype
    node = _padded_rows(batch.node, atoms, extra, {
        "positions": lambda v: torch.cat([v.detach(), v.new_zeros(extra, *v.shape[1:])]).requires_grad_(True),
        "batch": lambda v: torch.cat([v, v.new_full((extra,), systems)]),
        "atom_ids": lambda v: torch.cat([v, -1 - torch.arange(extra, device=device, dtype=v.dtype)]),
        # the padding system is summed over its atoms on every rank like any other (compiled_sums):
        # never an empty sum, whose 0 / 0 a charge equilibration would turn into NaN
        OWNED_ROWS: lambda v: torch.cat([v, v.new_ones(extra)]),
    })
    system = _padded_rows(batch.system, systems, 1, {
        "cell": lambda v: torch.cat([v.detach(), (torch.eye(3, dtype=v.dtype, device=device) * (reach + 1.0))[None]]),
        "pbc": lambda v: torch.cat([v, v.new_ones(1, *v.shape[1:])]),
    })
    counts = batch.atoms_per_system if counts is None else counts
    padded = FixedCounts.of(node, system, torch.cat([counts, counts.new_full((1,), extra)]))
    padded.neighbors = _padded_list(batch.neighbors, caps.edges, atoms, extra, dtype)
    padded.n_owned = atoms
    return padded


def _padded_rows(fields: dict, rows: int, extra: int, special: dict) -> dict:
    """``fields`` with ``extra`` rows appended to every tensor of ``rows`` rows: by ``special``'s
    rule for its names, else copies of the first row (a species and charges every model
    accepts); outputs dropped, other values kept."""
    padded = {}
    for name, value in fields.items():
        if name in OUTPUT_FIELDS:
            continue
        if not torch.is_tensor(value) or value.shape[:1] != (rows,):
            padded[name] = value
        elif name in special:
            padded[name] = special[name](value)
        else:
            padded[name] = torch.cat([value, value[:1].expand(extra, *value.shape[1:])])
    return padded


def unpad_outputs(outputs: dict, cap_atoms: int, atoms: int, systems: int) -> dict:
    """The real atoms' and systems' rows of a padded call's outputs."""
    result = {}
    for name, value in outputs.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if name in PER_SYSTEM or value.shape[0] == systems + 1:
                value = value[:systems]
            elif value.shape[0] == cap_atoms:
                value = value[:atoms]
        result[name] = value
    return result


def _padded_list(source: NeighborList, slots: int, atoms: int, extra: int, dtype) -> NeighborList:
    null = slots - source.num_edges
    index_dtype, device = source.edge_index.dtype, source.edge_index.device
    owner = atoms + torch.arange(null, device=device, dtype=index_dtype) % extra  # spread over the padding atoms
    shifts = torch.zeros(null, 3, dtype=source.unit_shifts.dtype, device=device)
    shifts[:, 0] = 1.0  # one padding-cell vector: reach + 1 long
    return NeighborList(torch.cat([source.edge_index, owner.expand(2, -1)], dim=1),
                        torch.cat([source.unit_shifts, shifts]), source.cutoff, source.full_list, padded=True)


class FixedCounts(Batch):
    """A batch whose atoms per system are known: ``ptr`` without a ``bincount`` (a
    data-dependent op that breaks a compiled graph, and a host read a CUDA graph's capture
    refuses: NOTE [host reads under capture] in mlipdd.distributed.cuda_graph)."""

    @classmethod
    def of(cls, node: dict, system: dict, counts: torch.Tensor) -> FixedCounts:
        batch = cls._from_dicts(node, system)
        object.__setattr__(batch, "_counts", counts)
        object.__setattr__(batch, "_ptr", torch.cat([counts.new_zeros(1), counts.cumsum(0)]))
        return batch

    @property
    def ptr(self) -> torch.Tensor:
        fixed = self.__dict__.get("_ptr")  # absent on a copy (.to, .clone): counted again
        return fixed if fixed is not None else Batch.ptr.fget(self)

    @property
    def atoms_per_system(self) -> torch.Tensor:
        fixed = self.__dict__.get("_counts")
        return fixed if fixed is not None else Batch.atoms_per_system.fget(self)


def _shape_key(batch: Batch, compute_stress: bool) -> tuple:
    fields = tuple(sorted((store, name, tuple(v.shape), v.dtype)
                          for store, values in (("node", batch.node), ("system", batch.system))
                          for name, v in values.items() if torch.is_tensor(v)))
    return (compute_stress, fields, batch.neighbors.num_edges)


def _check_compilable(batch: Batch) -> None:
    if type(batch.positions) is not torch.Tensor:
        raise InputError(
            "DomainConfig(compile=True) compiles the force call of one rank on plain tensors; this "
            "batch is distributed (ShardTensor rows): run on one rank or leave compile=False"
        )
    if batch.neighbors is None:
        raise InputError("a compiled force call needs the batch's neighbour list (batch.neighbors)")

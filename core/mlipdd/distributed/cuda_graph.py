"""`GraphedForceCall`: a model's whole force call captured once in a CUDA graph, replayed.

Why: a small system's force call is bound by host time, not device time. A medium MACE
on 1000 atoms launches about 900 kernels per energy + forces call; launching them costs
more host time than the device needs to run them. A CUDA graph records the launches
once and replays them with one call, so the host cost all but disappears.

What a graph fixes: the address and shape of every tensor it reads or writes. So the
model runs on *static inputs* (`StaticInputs`): a batch whose tensors are allocated once
and refreshed in place before each replay.

* float tensors (positions, cell, extra per-atom inputs) are copied in every call;
  the positions buffer is a leaf that requires grad, as the model's force backward needs;
* integer and boolean tensors (atomic numbers, system index, atom ids, pbc) are
  structure: the model may have derived host-side facts from them while the graph was
  captured (an element check, a one-hot table), so a change of their values means a new
  capture. Checking costs a host read only when the caller hands in a different tensor
  (at one rank: after a neighbour-list rebuild, which reads the host anyway);
* the neighbour list lives in buffers of a fixed CAPACITY of edges, see NOTE [null edges];
  with ``trim_to`` only the edges within the model's cutoff go in, chosen anew each call
  (a Verlet list's skin edges would otherwise cost the graph a third more edge work).

A new capture happens when the atom count, the stress flag, a dtype or the set of fields
changes, when the structure above changes, or when the edges outgrow the capacity (the
new capacity is ``headroom`` times their number). Nothing else recaptures; one graph is
kept for each value of the stress flag.

# NOTE [null edges]
A neighbour-list rebuild changes the number of edges, but a graph cannot. The edges
go into buffers of ``capacity`` slots and the unused slots hold *null edges*: an atom
joined to its own periodic image ``n`` cell vectors away, ``n`` chosen so that the edge
is at least ``reach + 1`` long (``reach``: the radius the list was built with, cutoff +
skin). The model must give such an edge exactly zero weight, in the energy and in its
gradient. Every model here does, because a Verlet list with a skin holds edges longer
than the cutoff anyway: LJ masks them, MACE multiplies each edge by its cutoff envelope,
which is 0 beyond ``r_max`` (`mlipdd_mace.graph`). Null edges are spread over the atoms
(edge k belongs to atom ``k mod n_atoms``) so that no single row takes every scatter.

# NOTE [host reads under capture]
Nothing inside the captured call may read the device on the host (``.item()``,
``bool(t)``, ``bincount`` on CUDA, boolean-mask indexing): CUDA refuses it while a stream
is capturing. `StaticInputs` gives the model a batch whose ``ptr`` is precomputed (the
default one counts atoms with ``bincount``) and whose list is marked ``padded`` (a model
keeps every edge of it, so there is nothing to filter, and the warm-up runs the very
shapes the capture records). A wrapper that checks its inputs on the host skips that
while `mlipdd.models.capturing` (the MACE and LJ wrappers do); the warm-up calls before
the capture run eagerly, so such checks still run once per capture. A wrapper that
caches a device tensor derived from its inputs must not drop it while a graph that read
it lives: compute it inside the captured call instead (as `mlipdd_mace.graph` does).

Memory: a graph keeps the working memory of its call (activations of the forward and
backward) allocated for as long as it lives, and one is kept per stress flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlipdd.data import Batch, InputError
from mlipdd.distributed.compiled import FixedCounts
from mlipdd.neighbors import NeighborList
from mlipdd.strategy.skin import edges_in_cutoff

__all__ = ["GraphedForceCall", "StaticInputs", "capture_graph", "fill_edges", "null_edges", "null_shifts",
           "pad_with_null_edges"]

ForceCall = Callable[[Batch, bool], dict]
TRIM_MARGIN = 1e-3  # A: rounding may put an edge the model counts a hair past its cutoff


class GraphedForceCall:
    """``call(batch, compute_stress) -> outputs``, captured in a CUDA graph and replayed.

    ``call`` is the model's force call (run under whatever contexts the caller needs;
    they are entered during the warm-up and the capture, not at replay). The batch must
    carry a neighbour list (``batch.neighbors``, built with a ``cutoff``) and live on a
    CUDA device. Outputs are fresh tensors (clones of the graph's own), so they survive
    the next replay. One graph is kept per value of ``compute_stress`` (MD that asks for
    the stress every few steps does not recapture). ``captures`` counts captures,
    ``replays`` calls; ``capacity`` is the edge capacity of the graph used last. See the
    module docstring for what recaptures.

    ``trim_to``: a list built with a Verlet skin holds edges up to cutoff + skin, a third
    more than the model weighs at a 6 A cutoff plus 0.5 A skin; the graph would compute
    them all (it cannot filter: its shapes are fixed). With ``trim_to=cutoff`` every call
    first keeps the edges shorter than ``cutoff`` (plus a rounding margin of
    ``TRIM_MARGIN``) at the current positions, at the price of one host read (their
    count) and a dozen small kernels; the edges dropped weigh zero in the model anyway.
    ``headroom``: edge capacity of a new graph / the edges it was captured with.
    """

    def __init__(self, call: ForceCall, headroom: float = 1.1, warmup: int = 3, trim_to: float | None = None):
        if not headroom >= 1.0:
            raise InputError(f"headroom must be >= 1 (edge capacity / edges at capture), got {headroom}")
        self.call = call
        self.headroom = float(headroom)
        self.warmup = int(warmup)
        self.trim_to = None if trim_to is None else float(trim_to)
        self.captures = 0
        self.replays = 0
        self._graphs: dict[bool, _Captured] = {}
        self._last: _Captured | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._last is None else self._last.inputs.capacity

    def __call__(self, batch: Batch, compute_stress: bool = False) -> dict:
        self._check(batch)
        compute_stress = bool(compute_stress)
        if self.trim_to is not None:
            trimmed = edges_in_cutoff(batch.neighbors, batch.positions, batch.cell, batch.batch,
                                      self.trim_to + TRIM_MARGIN)
            batch = _with_neighbors(batch, trimmed)
        captured = self._graphs.get(compute_stress)
        if captured is None or not captured.inputs.holds(batch, compute_stress):
            captured = self._capture(batch, compute_stress)
        else:
            captured.inputs.load(batch)
        captured.replay()
        self.replays += 1
        self._last = captured
        return {name: value.clone() if torch.is_tensor(value) else value
                for name, value in captured.outputs.items()}

    def reset(self) -> None:
        """Drop the graphs and their memory; the next call captures again."""
        self._graphs.clear()
        self._last = None

    def _capture(self, batch: Batch, compute_stress: bool) -> _Captured:
        self._last = None
        self._graphs.pop(compute_stress, None)  # the old graph's memory goes before the new one's
        edges = batch.neighbors.num_edges
        capacity = max(math.ceil(self.headroom * edges), edges + 16)
        inputs = StaticInputs(batch, compute_stress, capacity)
        replay, outputs = self._record(inputs, compute_stress)
        captured = _Captured(replay, inputs, dict(outputs))
        self._graphs[compute_stress] = captured
        self.captures += 1
        return captured

    def _check(self, batch: Batch) -> None:
        check_graphable(batch)

    def _record(self, inputs: StaticInputs, compute_stress: bool) -> tuple[Callable[[], None], dict]:
        """Warm up, capture ``call`` on the static inputs; returns (replay, the graph's outputs)."""
        return capture_graph(lambda: self.call(inputs.batch, compute_stress), self.warmup, inputs.batch.device)


def capture_graph(call: Callable[[], object], warmup: int, device) -> tuple[Callable[[], None], object]:
    """``call()`` warmed up ``warmup`` times on a side stream (lazy initialisation of
    libraries and autograd, a wrapper's one-off checks and caches), then captured in a
    CUDA graph; returns (the graph's replay, the outputs of the captured call, which
    every replay rewrites in place)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = call()
    except Exception as error:
        raise RuntimeError(
            "the model's force call could not be captured in a CUDA graph (usually an op "
            f"that reads the device on the host inside the forward): {error}. Make the wrapper "
            "skip host reads while torch.cuda.is_current_stream_capturing(), or run with "
            "DomainConfig(cuda_graph=False)"
        ) from error
    return graph.replay, outputs


@dataclass
class _Captured:
    replay: Callable[[], None]  # a CUDA graph's replay
    inputs: StaticInputs
    outputs: dict  # the graph's own output tensors, rewritten by every replay


def check_graphable(batch: Batch) -> None:
    if not batch.positions.is_cuda:
        raise InputError(
            f"DomainConfig(cuda_graph=True) replays a CUDA graph, but the atoms are on "
            f"{batch.positions.device}: partition onto a CUDA device (model and batch on the GPU) "
            "or leave cuda_graph=False"
        )
    if type(batch.positions) is not torch.Tensor:
        raise InputError(
            "DomainConfig(cuda_graph=True) runs on plain tensors (one rank); this batch is "
            "distributed: run on one rank or leave cuda_graph=False"
        )
    neighbors = batch.neighbors
    if neighbors is None or neighbors.cutoff is None:
        raise InputError(
            "a graphed force call needs the batch's neighbour list, built with a cutoff "
            "(mlipdd.neighbors.build_neighbor_list); attach one as batch.neighbors"
        )


class StaticInputs:
    """The tensors a graph reads: allocated once from ``batch``, refreshed by `load`.

    ``batch`` is the static batch the model runs on; its ``neighbors`` hold ``capacity``
    edge slots (NOTE [null edges]).
    """

    def __init__(self, batch: Batch, compute_stress: bool, capacity: int):
        if batch.num_atoms == 0:
            raise InputError("a graphed force call needs at least one atom; this batch has none")
        self.layout = layout_of(batch, compute_stress)
        self.capacity = int(capacity)
        source = batch.neighbors
        self.reach = float(source.cutoff)
        node, system = {}, {}
        for store, out in ((batch.node, node), (batch.system, system)):
            for name, value in store.items():
                out[name] = value.detach().clone() if torch.is_tensor(value) else value
        node["positions"].requires_grad_(True)  # a leaf: the force backward differentiates it
        counts = Batch.atoms_per_system.fget(batch)  # counted (a host read) here, never at replay
        self.batch = FixedCounts.of(node, system, counts)
        _check_cells(self.batch.cell)
        self._null = null_edges(self.capacity, self.batch.cell, self.batch.batch, self.reach, source)
        self.batch.neighbors = NeighborList(self._null.edge_index.clone(), self._null.unit_shifts.clone(),
                                            source.cutoff, source.full_list, padded=True)
        # tensors last seen per structural field / cell / list, to skip checks while they hold
        self._seen: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}
        self._list_source: NeighborList | None = None
        self._cell_seen: tuple[torch.Tensor, int] | None = None
        for name, value in _structure(batch):
            self._seen[name] = (value, value._version)
        self.load(batch)

    # ---- deciding -------------------------------------------------------------------------
    def holds(self, batch: Batch, compute_stress: bool) -> bool:
        """Whether the current graph can run ``batch`` (else: capture again)."""
        if layout_of(batch, compute_stress) != self.layout:
            return False
        if batch.neighbors is not self._list_source and batch.neighbors.num_edges > self.capacity:
            return False
        return self._same_structure(batch)

    def _same_structure(self, batch: Batch) -> bool:
        changed = [(name, value) for name, value in _structure(batch) if not _unchanged(self._seen.get(name), value)]
        if not changed:
            return True
        mine = _fields(self.batch)
        # one host read for all of them
        equal = torch.stack([(mine[name] == value).all() for name, value in changed])
        if not bool(equal.all()):
            return False
        for name, value in changed:
            self._seen[name] = (value, value._version)
        return True

    # ---- refreshing ------------------------------------------------------------------------
    def load(self, batch: Batch) -> None:
        """Copy this call's float inputs in; at a new list (or cell), refill the edges."""
        mine = _fields(self.batch)
        with torch.no_grad():
            for name, value in _fields(batch).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    mine[name].copy_(value.detach())
        cell = batch.cell
        if not _unchanged(self._cell_seen, cell):  # null edges are as long as the cell is
            static = self.batch
            self._null = null_edges(self.capacity, static.cell, static.batch, self.reach, static.neighbors)
            self._cell_seen = (cell, cell._version)
            self._list_source = None
        if batch.neighbors is not self._list_source:
            fill_edges(self.batch.neighbors, batch.neighbors, self._null)
            self._list_source = batch.neighbors


def fill_edges(target: NeighborList, source: NeighborList, null: NeighborList) -> None:
    """Copy ``source``'s edges into the first slots of ``target`` (fixed-size buffers) and
    the null edges of the same slots of ``null`` into the rest (NOTE [null edges]).

    Device work only, no host read: safe between replays."""
    edges, capacity = source.num_edges, target.num_edges
    if edges > capacity:
        raise InputError(f"{edges} edges do not fit a graph's {capacity} edge slots; capture again")
    with torch.no_grad():
        target.edge_index[:, :edges].copy_(source.edge_index)
        target.unit_shifts[:edges].copy_(source.unit_shifts)
        if edges < capacity:
            target.edge_index[:, edges:].copy_(null.edge_index[:, edges:])
            target.unit_shifts[edges:].copy_(null.unit_shifts[edges:])


def null_edges(capacity: int, cell: torch.Tensor, system_of_atom: torch.Tensor, reach: float,
               like: NeighborList) -> NeighborList:
    """``capacity`` null edges: slot k joins atom ``k mod n_atoms`` to its own image
    ``null_shifts`` away, longer than ``reach`` (dtypes and device of ``like``)."""
    device = like.edge_index.device
    with torch.no_grad():
        atom = torch.arange(int(capacity), device=device) % system_of_atom.shape[0]
        shifts = null_shifts(cell.detach(), reach)[system_of_atom[atom]]
    return NeighborList(atom.expand(2, -1).to(like.edge_index.dtype).contiguous(),
                        shifts.to(like.unit_shifts.dtype), like.cutoff, like.full_list, padded=True)


def pad_with_null_edges(source: NeighborList, batch: Batch, capacity: int,
                        reach: float | None = None) -> NeighborList:
    """A new list: ``source``'s edges, then null edges up to ``capacity`` (what a graph's
    buffers hold); ``reach`` defaults to the radius ``source`` was built with."""
    reach = float(source.cutoff if reach is None else reach)
    null = null_edges(capacity, batch.cell, batch.batch, reach, source)
    target = NeighborList(null.edge_index.clone(), null.unit_shifts.clone(), source.cutoff, source.full_list,
                          padded=True)
    fill_edges(target, source, null)
    return target


def null_shifts(cell: torch.Tensor, reach: float) -> torch.Tensor:
    """Per system, the integer image shift ``n`` along its longest cell vector that puts an
    atom's image at least ``reach + 1`` away: (n_systems, 3), in the cell's dtype."""
    lengths = cell.norm(dim=2)  # (n_systems, 3)
    longest, axis = lengths.max(dim=1)
    n = torch.ceil((reach + 1.0) / longest)
    shifts = torch.zeros_like(lengths)
    return shifts.scatter(1, axis[:, None], n[:, None])


def layout_of(batch: Batch, compute_stress: bool) -> tuple:
    """Everything a graph's shapes depend on, as a host-side key (no device read)."""
    neighbors = batch.neighbors
    fields = tuple(sorted((name, _describe(value)) for name, value in _fields(batch).items()))
    return (bool(compute_stress), fields, neighbors.edge_index.dtype, neighbors.unit_shifts.dtype,
            neighbors.full_list, neighbors.cutoff)


def _describe(value) -> tuple:
    if torch.is_tensor(value):
        return ("tensor", value.dtype, tuple(value.shape), value.device)
    if isinstance(value, (int, float, str, bool, type(None))):
        return ("value", value)
    return ("object", id(value))


def _with_neighbors(batch: Batch, neighbors: NeighborList) -> Batch:
    view = Batch._from_dicts(dict(batch.node), dict(batch.system))
    view.neighbors = neighbors
    return view


def _unchanged(seen: tuple[torch.Tensor, int] | None, value: torch.Tensor) -> bool:
    """The very tensor seen before, not modified in place since (no device read)."""
    return seen is not None and seen[0] is value and seen[1] == value._version


def _fields(batch: Batch) -> dict:
    """Every field of the batch, keyed by (store, name): a node and a system field may share a name."""
    return {**{("node", k): v for k, v in batch.node.items()}, **{("system", k): v for k, v in batch.system.items()}}


def _structure(batch: Batch):
    """The integer and boolean tensors: a change of their values means a new capture."""
    return [(name, value) for name, value in _fields(batch).items()
            if torch.is_tensor(value) and not value.is_floating_point()]


def _check_cells(cell: torch.Tensor) -> None:
    if bool((cell.norm(dim=2).max(dim=1).values == 0).any()):
        raise InputError(
            "a graphed force call pads its edge buffers with an atom's periodic image, so every "
            "system needs a cell (a box around a cluster, with pbc False, will do)"
        )

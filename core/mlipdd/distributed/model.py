"""`DistributedModel`: runs an unchanged model wrapper on this rank's subdomain.

Per call: agree on input validity -> (rebuild: migrate, halo plan, local list) ->
padded positions as a ShardTensor -> the wrapper's own forward, with the spec's
adapters installed -> outputs consolidated by kind (forces back to owners, energy
already replicated, partial stress summed).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mlipdd.comm import (
    agree_on_errors,
    check_together,
    collective_device,
    fail_together,
    group_rank,
    group_size,
    nccl_device,
)
from mlipdd.data import Batch, InputError, check_not_empty
from mlipdd.distributed.compiled import CompiledForceCall
from mlipdd.distributed.compiled_halo import CompiledHaloCall, compiled_on_ranks
from mlipdd.distributed.compiled_partition import CompiledPartitionCall
from mlipdd.distributed.config import DomainConfig, resolve_strategy
from mlipdd.distributed.cuda_graph import TRIM_MARGIN, GraphedForceCall
from mlipdd.distributed.empty_rank import explained_on_an_empty_rank
from mlipdd.plugins import get_strategy
from mlipdd.shard.custom_ops import activated
from mlipdd.spec.patching import installed
from mlipdd.strategy.halo import HaloStrategy
from mlipdd.strategy.skin import edges_in_cutoff


def resolve_spec(model, strategy: str, spec=None):
    """The spec to run under: given, the wrapper's own, or the MPNN halo default."""
    if spec is None:
        spec = model.distribution_spec(strategy)
    if spec is None:
        from mlipdd.spec.presets import SPEC_MPNN_HALO

        spec = SPEC_MPNN_HALO
    return spec


class DistributedModel(nn.Module):
    """``DistributedModel(model, config, spec=None)``; call it on this rank's owned batch.

    Returns ``energy`` (n_systems,) replicated on every rank, ``forces`` for the owned
    atoms, ``stress`` (n_systems, 3, 3) replicated when asked, and any other per-atom
    output for the owned atoms. The owned batch is updated in place when atoms migrate
    (at neighbour-list rebuilds), so keep using the same object.

    With ``DomainConfig(cuda_graph=True)`` (one rank, CUDA) the model's force call is
    replayed from a CUDA graph (`mlipdd.distributed.cuda_graph`); ``cuda_graph_captures``
    counts its captures. With ``DomainConfig(compile=True)`` it runs through
    ``torch.compile`` at padded caps (`mlipdd.distributed.compiled`; at several ranks
    `compiled_halo` and `compiled_partition`); ``compile_stats``
    counts compiles, recompiles and eager checks.
    """

    def __init__(self, model, config: DomainConfig, spec=None, group=None):
        super().__init__()
        if not isinstance(model, nn.Module) or not hasattr(model, "model_config"):
            from mlipdd.plugins import wrap_model

            model = wrap_model(model)
        config = resolve_strategy(config, model, group_size(group), own_spec=spec is None)
        self.model = model
        self.config = config
        self.group = group
        strategy_cls = get_strategy(config.strategy_name)
        self.spec = resolve_spec(model, config.strategy, spec)
        policy = self.spec.distribution.policy
        if not strategy_cls.accepts(policy):
            raise InputError(
                f"the spec's policy {type(policy).__name__} does not fit the {config.strategy_name} "
                "strategy; use a spec made for it or choose the matching DomainConfig.strategy"
            )
        if config.cutoff < model.cutoff - 1e-12:
            raise InputError(
                f"DomainConfig.cutoff {config.cutoff} is smaller than the model's cutoff "
                f"{model.cutoff}; ghosts would be missing: use DomainConfig(cutoff=model.cutoff)"
            )
        self.strategy = strategy_cls.from_config(config, group)
        self._world_size = group_size(group)  # as built: group_size reads 1 once the group is gone
        self.strategy.use_spec(self.spec)
        self.last_padded: Batch | None = None
        self._calls = 0  # NOTE [deferred checks]
        self._check_now = True
        self._prepared = None  # (batch, positions, version) the stage ran for: NOTE [decomposition stage]
        self._graphed: GraphedForceCall | None = None
        if config.cuda_graph:
            if self.strategy.world_size > 1:
                raise InputError(
                    f"DomainConfig(cuda_graph=True) captures the force call of ONE rank; this run has "
                    f"{self.strategy.world_size} ranks (their halo exchanges are not captured): "
                    "leave cuda_graph=False with several ranks"
                )
            # the list reaches cutoff + skin; each call hands the graph only the edges within
            # the cutoff (the rest weigh zero), so the graph does the bare model's work
            trim = config.cutoff if config.skin > 0 else None
            self._graphed = GraphedForceCall(self._call_model, trim_to=trim)
        self._compiled: CompiledForceCall | None = None
        # the compiled call that issues its own collectives: halo / sharded storage (CompiledHaloCall, also
        # one rank of sharded storage) or graph partition (CompiledPartitionCall)
        self._compiled_ranks: CompiledHaloCall | CompiledPartitionCall | None = None
        if config.compile:
            self._build_compiled(model, config)

    def _build_compiled(self, model, config: DomainConfig) -> None:
        options = {"reach": config.halo_width, "backend": config.compile_backend, "headroom": config.compile_headroom}
        def model_call(batch, stress):  # the contexts are entered around the compiled call
            return self.model(batch, compute_stress=stress)

        if self.strategy.whole_system:  # graph partition: collectives traced in (compiled_partition)
            autograd_outputs = getattr(model.model_config, "autograd_outputs", frozenset())
            self._compiled_ranks = self._compiled = CompiledPartitionCall(
                model_call, self.strategy, self.spec, self.group, autograd_outputs, backend=config.compile_backend)
            return
        if self.strategy.world_size == 1 and isinstance(self.strategy, HaloStrategy):
            self._compiled = CompiledForceCall(model_call, model_call, **options)
            return
        # halo and sharded storage (also sharded at one rank: its halo plan's rows, NOTE [sharded, compiled])
        self._compiled_ranks = compiled_on_ranks(model, self.strategy, self.spec, self.group, config, **options)
        self._compiled = self._compiled_ranks.inner  # its counters

    @property
    def cutoff(self) -> float:
        return self.model.cutoff

    @property
    def cuda_graph_captures(self) -> int:
        """How many times the force call was captured in a CUDA graph (0: not graphed)."""
        return 0 if self._graphed is None else self._graphed.captures

    @property
    def compile_stats(self) -> dict | None:
        """With ``compile=True``: ``compiles`` (distinct padded shapes compiled), ``recompiles``
        (those after the first), ``graphs`` (graphs the backend built), ``checks`` (eager
        comparisons), ``compile_seconds``, ``caps`` (atoms, edges) and ``backend``; else None."""
        c = self._compiled
        if c is None:
            return None
        caps = None if c.caps is None else (c.caps.atoms, c.caps.edges)
        return {"backend": c.backend, "compiles": c.compiles, "recompiles": c.recompiles, "graphs": c.graphs,
                "checks": c.checks, "compile_seconds": round(c.compile_seconds, 3), "caps": caps}

    @property
    def load_imbalance(self) -> float | None:
        """Max/mean owned atoms per rank at the latest rebuild (None: not measured)."""
        return self.strategy.report()["load_imbalance"]

    def partition(self, full: Batch | None, device=None) -> Batch:
        """Rank 0 holds the full system (None elsewhere); returns this rank's owned atoms,
        on ``device`` (default: where the model's parameters live)."""
        if device is None:
            tensor = next(iter([*self.model.parameters(), *self.model.buffers()]), None)
            device = tensor.device if tensor is not None else nccl_device(self.group)
        self._require_group()
        with fail_together(self.group):
            check_together(_check_full_system, full, group_rank(self.group) == 0, group=self.group)
            return self.strategy.partition(full, device)

    def _require_group(self) -> None:
        # NOTE [after a refused call]: a refusal that every rank agrees on (bad input at
        # partition or at a forward's checks) leaves the group intact, so each rank may
        # catch it and call again. An error inside the model's forward cannot be agreed on
        # (the peers may wait in a collective): `fail_together` tears the group down on
        # EVERY rank; then every rank stops here, with the same words, instead of running
        # as a lone process or failing in torch's "not initialized".
        if self._world_size > 1 and not torch.distributed.is_initialized():
            raise RuntimeError(
                f"this DistributedModel ran on {self._world_size} ranks, and their process group "
                "was torn down on every rank when an earlier call failed inside the model (that error "
                "said why); start a new process group and build a new DistributedModel to go on"
            )

    def prepare(self, batch: Batch) -> None:
        """The decomposition stage (collective): check this call's inputs on every rank,
        then migrate and rebuild the halo plan when due; the next forward on the same
        ``batch`` (positions untouched since) uses it. See NOTE [decomposition stage]."""
        self._require_group()
        with fail_together(self.group):
            self._prepare(batch)

    def _prepare(self, batch: Batch) -> None:
        # NOTE [decomposition stage]
        # Before a force call the inputs are checked and the strategy learns whether to
        # rebuild, in ONE all-reduce of two flags: some rank's input is bad (the
        # strategy's `check`, finite positions), some rank's rebuild is due (its
        # `rebuild_due`). Only a bad input pays more: the ranks then agree on its message
        # (`agree_on_errors`). `DomainParallel` runs this as its own stage of the MD step
        # (BEFORE_COMPUTE, first), so migration and planning are not hidden in the force
        # call and the AFTER_POSITIONS/BEFORE_COMPUTE hooks of the next stages see owned
        # atoms; any other caller (the ASE calculator, validation) gets it from `forward`.
        #
        # NOTE [deferred checks]: a check read on the host stalls the device queue, so
        # in the steady state finite positions in and finite outputs out are checked on
        # the first call and every ``config.check_every`` calls. A NaN in MD does not go
        # away (NaN forces make NaN positions, which stay NaN), so it is reported a few
        # calls late, never lost; check_every=1 checks every call.
        self._calls += 1
        self._check_now = self._calls == 1 or self._calls % self.config.check_every == 0
        error = None
        try:
            self.strategy.check(batch)
            if self._check_now:
                _check_positions(batch)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        due = error is None and bool(self.strategy.rebuild_due(batch))
        failed, rebuild = any_of_ranks((error is not None, due), self.group)
        if failed:
            agree_on_errors(error, self.group)
        self.strategy.prepare(batch, rebuild)
        self._prepared = (batch, batch.positions, batch.positions._version)

    def _prepared_for(self, batch: Batch) -> bool:
        """Whether the decomposition stage ran for ``batch`` as it is now (the same
        positions tensor, not written in place since)."""
        token = self._prepared
        return (token is not None and token[0] is batch and token[1] is batch.positions
                and token[1]._version == token[2])

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        self._require_group()
        with fail_together(self.group):
            if not self._prepared_for(batch):
                self._prepare(batch)
            self._prepared = None  # one stage serves one force call
            check_now = self._check_now
            autograd_outputs = getattr(self.model.model_config, "autograd_outputs", frozenset())
            if self._compiled_ranks is not None:
                result = self._compiled_ranks_call(batch, compute_stress, autograd_outputs)
                if check_now:
                    agree_on_errors(_check_outputs(result), self.group)
                return result
            model_batch, meta = self.strategy.model_batch(batch, self.spec)
            self.last_padded = model_batch
            with self.strategy.model_scope(meta), explained_on_an_empty_rank(
                    batch.positions.shape[0], group_rank(self.group), group_size(self.group)):
                if self._graphed is not None:
                    outputs = self._graphed(model_batch, compute_stress)
                elif self._compiled is not None:
                    trimmed = self._within_cutoff(model_batch)
                    with installed(self.spec), activated(self.spec, row_ids=trimmed.atom_ids):
                        outputs = self._compiled(trimmed, compute_stress)
                else:
                    outputs = self._call_model(self._within_cutoff(model_batch), compute_stress)
            result = self.strategy.consolidate(outputs, meta, self.spec, autograd_outputs)
            if check_now:
                agree_on_errors(_check_outputs(result), self.group)
            return result

    def _compiled_ranks_call(self, batch: Batch, compute_stress: bool, autograd_outputs) -> dict:
        """Compiled with collectives (`mlipdd.distributed.compiled_halo`, `compiled_partition`).
        The compiled region reads plain rows of its own, so the dispatch does not run in it; its
        checks run the eager distributed forward, the strategy's rows made only for a check
        (collective: every rank checks, or none)."""
        partition = isinstance(self._compiled_ranks, CompiledPartitionCall)

        def eager():
            model_batch, meta = self.strategy.model_batch(batch, self.spec)
            with self.strategy.model_scope(meta):
                outputs = self._call_model(model_batch, compute_stress)
            return self.strategy.consolidate(outputs, meta, self.spec, autograd_outputs)

        @contextlib.contextmanager
        def installing(rows):  # around the compiled call only: the eager check installs its own (never
            with contextlib.ExitStack() as stack:  # nested: an adapter installed twice would wrap itself)
                stack.enter_context(installed(self.spec))
                if partition:  # the model's own code is compiled
                    stack.enter_context(activated(self.spec, row_ids=rows.atom_ids))
                yield

        result = self._compiled_ranks(batch, compute_stress, eager, installing)
        self.last_padded = self._compiled_ranks.last_rows
        return result

    def _within_cutoff(self, model_batch: Batch) -> Batch:
        """At one rank, the batch with only the list's edges within the cutoff.

        # NOTE [skin edges at one rank]
        The list reaches cutoff + skin so that it lasts several steps; the model gives the
        skin edges zero weight (NeighborConfig's contract) but still computes them: 25-35%
        more edge work for MACE at a 0.5 A skin, where edges are most of the cost. At one
        rank nothing else reads the list, so the model gets the edges within its cutoff
        (one host read and a few kernels per call). Under several ranks the edge rows are
        part of the decomposition's bookkeeping and stay as built."""
        neighbors = model_batch.neighbors
        if self.config.skin == 0 or self.strategy.world_size > 1 or neighbors is None:
            return model_batch
        if getattr(neighbors.edge_index, "_meta", None) is not None:  # edge rows a strategy tracks
            return model_batch
        view = Batch._from_dicts(dict(model_batch.node), dict(model_batch.system))
        view.neighbors = edges_in_cutoff(neighbors, model_batch.positions, model_batch.cell, model_batch.batch,
                                         self.config.cutoff + TRIM_MARGIN)
        view.n_owned = getattr(model_batch, "n_owned", None)
        return view

    def _call_model(self, model_batch: Batch, compute_stress: bool) -> dict:
        with installed(self.spec), activated(self.spec, row_ids=model_batch.atom_ids):
            return self.model(model_batch, compute_stress=compute_stress)


def any_of_ranks(flags, group) -> list[bool]:
    """Per flag, whether it is True on some rank: one all-reduce for all of them."""
    if group_size(group) == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([int(bool(f)) for f in flags], device=collective_device(group))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def _check_full_system(full: Batch | None, is_root: bool) -> None:
    if is_root and isinstance(full, Batch):  # other inputs: the strategy names the problem
        check_not_empty(full)


def _check_positions(batch: Batch) -> None:
    """The per-step check (cheap); the full validation runs at every rebuild."""
    if not torch.isfinite(batch.positions).all():
        bad = torch.nonzero(~torch.isfinite(batch.positions).all(1)).flatten()[:5]
        raise InputError(
            f"positions contain NaN or inf (atom ids {batch.atom_ids[bad].tolist()}); the system blew "
            "up or was built wrongly: check the structure, or lower the time step in MD"
        )


def _check_outputs(result: dict) -> BaseException | None:
    for name in ("energy", "forces", "stress"):
        value = result.get(name)
        if value is not None and not torch.isfinite(value).all():
            return FloatingPointError(
                f"the distributed {name} contains NaN/inf. If the single-process model is finite, "
                "run mlipdd.validate.trace_and_validate to locate the op that differs across ranks"
            )
    return None

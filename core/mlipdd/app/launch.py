"""``mlipdd run`` on several ranks: start local ranks, or join the ones a launcher started.

* ``mlipdd run --nproc N`` (no launcher around it): this process starts N ranks itself,
  one subprocess each, with the environment torchrun would give them (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and the run settings
  in a JSON file, and supervises them (`mlipdd.distributed.supervise`): they die with
  the launcher, SIGTERM / SIGHUP / Ctrl-C stop every rank cleanly after the same step,
  and a rank that dies is named with its exit code or signal. When one rank fails the
  others stop together with its message (`fail_together`); any that are still alive
  after a grace period are terminated.
* under torchrun (``WORLD_SIZE`` set) or inside an ``srun`` step with several tasks,
  each process *is* a rank and joins the group (`run_distributed_simulation`).

The distributed run mirrors `mlipdd.app.simulation.run_simulation`: the same
model, system (built on rank 0 only), integrator and hooks, wrapped in `DomainParallel`.
Its summary adds the number of ranks, whether every atom (by id) is still there at
the end, and the largest force difference against one process on the first step
(rank 0 evaluates the unchanged model on the full system once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Any

import torch

from mlipdd.data import InputError

# a rank follows its launcher (dies with it) before the run's own imports and set-up
_CHILD = (
    "import sys; from mlipdd.distributed.supervise import follow_launcher; follow_launcher(); "
    "from mlipdd.cli import main; sys.exit(main(sys.argv[1:]))"
)


def launched_world_size() -> int:
    """Ranks started by an outside launcher (torchrun, srun); 1 when there is none."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    if os.environ.get("SLURM_PROCID") and os.environ.get("SLURM_STEP_NUM_TASKS"):
        return int(os.environ["SLURM_STEP_NUM_TASKS"])
    return 1


def _launched_rank() -> int:
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def run_command(cfg, json_output: bool = False) -> int:
    """What ``mlipdd run`` does once it knows the run is distributed."""
    world = launched_world_size()
    if world == 1:
        return spawn_local(cfg, json_output)
    if cfg.nproc > 1 and cfg.nproc != world:
        raise InputError(
            f"--nproc {cfg.nproc} but the launcher started {world} ranks; drop --nproc under "
            "torchrun/srun (the launcher decides the number of ranks)"
        )
    summary = run_distributed_simulation(cfg)
    if summary is not None:  # rank 0
        from mlipdd.app.simulation import format_summary

        print(json.dumps(summary, indent=2) if json_output else format_summary(summary), flush=True)
    return 0


# ---- starting local ranks -----------------------------------------------------------------
def spawn_local(cfg, json_output: bool = False) -> int:
    """Start ``cfg.nproc`` local ranks running this configuration; wait; exit code."""
    from mlipdd.comm import free_port
    from mlipdd.distributed.supervise import Supervisor

    nproc = int(cfg.nproc)
    settings = dataclasses.asdict(cfg)
    with tempfile.TemporaryDirectory(prefix="mlipdd-run-") as tmp:
        config_path = os.path.join(tmp, "run.json")
        with open(config_path, "w", encoding="utf-8") as handle:
            json.dump(settings, handle)
        port = free_port()
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
        command = [sys.executable, "-c", _CHILD, "run", "--config", config_path]
        if json_output:
            command.append("--json")
        supervisor = Supervisor()
        with supervisor.catching_signals():  # from before the first rank starts
            for rank in range(nproc):
                env = dict(
                    os.environ,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                    OMP_NUM_THREADS=threads,
                )
                supervisor.start(command, env)
            return supervisor.wait()


# ---- one rank -----------------------------------------------------------------------------
def run_distributed_simulation(cfg, thermo_stream=None) -> dict[str, Any] | None:
    """One rank of a distributed ``mlipdd run``; the summary on rank 0, None elsewhere."""
    from mlipdd.app.output_errors import reported_by_failing_rank, write_error_message
    from mlipdd.app.simulation import stopped_message
    from mlipdd.comm import DistributedInputError, RemoteRankError
    from mlipdd.distributed.manager import DistributedManager
    from mlipdd.dynamics.stop import RunStopped, stop_on_signals

    manager = DistributedManager(
        rank=_launched_rank(), world_size=launched_world_size(), timeout_s=cfg.collective_timeout
    )
    try:
        if cfg.device == "auto":  # one device per rank, as the manager chose it
            cfg = dataclasses.replace(cfg, device=str(manager.device))
        with stop_on_signals():  # every rank alike: watching adds a per-step agreement
            return _run_rank(cfg, manager, thermo_stream)
    except InputError as exc:
        # bad input is the same error on every rank (agreed): say it once, no traceback;
        # found by one rank alone (a trajectory frame it could not write), that rank says it
        agreed = isinstance(exc, DistributedInputError) or getattr(exc, "raised_on_every_rank", False)
        if manager.rank == 0 or not agreed:
            print(f"mlipdd run: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except RunStopped as exc:  # every rank, after the same step, files written
        if manager.rank == 0:
            print(stopped_message(cfg, exc), file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    except RemoteRankError as exc:
        if reported_by_failing_rank(str(exc)):
            raise SystemExit(2) from None  # bad input or an unwritable output: that rank says it
        # the failing rank prints its own traceback; the others add one line each
        print(f"rank {manager.rank} stopped: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception as exc:
        # an output rank 0 cannot write (a full disk): one line, exit 2, like bad input
        message = write_error_message(exc, cfg)
        if message is not None:
            print(f"mlipdd run: error: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        hint = _lost_peer_hint(exc, cfg) if isinstance(exc, RuntimeError) else None
        if hint is None:
            raise
        print(f"rank {manager.rank} stopped: {hint}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        manager.cleanup()


def _lost_peer_hint(exc: BaseException, cfg) -> str | None:
    """A one-line explanation of a collective that failed because of another rank."""
    text = str(exc)
    lowered = text.lower()
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    first_line = first_line.split(". This is typically")[0][:200]  # gloo's long advice
    if "timed out" in lowered or "timeout" in lowered:
        return (
            f"a collective waited longer than collective_timeout = {cfg.collective_timeout:g} s "
            f"({first_line}): another rank stopped responding (suspended, in a debugger, "
            "swapping) or is far slower; raise --collective-timeout if steps really take that long"
        )
    if any(m in lowered for m in ("connection reset", "connection closed", "broken pipe", "peer")):
        return (
            f"lost contact with another rank during a collective ({first_line}): that rank died; "
            "the launcher's message names it"
        )
    return None


def _run_rank(cfg, manager, thermo_stream) -> dict[str, Any] | None:
    from mlipdd.app.restart import restored_or_partitioned
    from mlipdd.app.simulation import (
        _summary,
        build_dynamics,
        build_model,
        default_hooks,
        domain_config,
        force_call_summary,
        prepare_system,
        timed_run,
    )
    from mlipdd.comm import broadcast_object, check_together, compute_on_rank0
    from mlipdd.distributed.domain_parallel import DomainParallel

    rank = manager.rank
    # agreed (a collective): a rank that fails at once must not leave before its peers have
    # joined the group, or they die in the rendezvous with a transport error instead of this
    check_together(cfg.checked)
    if cfg.checkpoint:  # rank 0 writes it: a second run on the same path stops at once
        from mlipdd.distributed.checkpoint import hold_checkpoint_path

        compute_on_rank0(hold_checkpoint_path, cfg.checkpoint)  # until this process ends
    # rank 0 builds (or reads) the system and fills in its defaults; every rank runs with
    # them, the model included (a restart's is the checkpoint's: mlipdd.app.restart)
    prepared = compute_on_rank0(prepare_system, cfg)
    cfg = broadcast_object(None if prepared is None else prepared[0])
    full = None if prepared is None else prepared[1]
    model = check_together(build_model, cfg)
    hooks = default_hooks(cfg, thermo_stream)
    dynamics = build_dynamics(cfg, model)
    # with --cuda-graph / --compile too: DistributedModel refuses them at several ranks by name
    config = check_together(domain_config, cfg, model)
    with DomainParallel(dynamics, config, cfg.steps, hooks, spec=_default_spec(model, config)) as dp:
        owned = restored_or_partitioned(dp, cfg, full)
        dynamics.setup(owned)  # first force evaluation, outside the timing
        force_diff = _first_step_force_difference(dp, model, full)
        first_step, wall, start_energy, end_energy = timed_run(dp, dynamics, owned)
        end = dp.gather()
        # collective (temperature, atom count reduce over ranks): every rank computes it
        summary = _summary(cfg, dynamics, owned, hooks[0].records, wall, start_energy, end_energy,
                           first_step)
        grid = dp.strategy.report()["grid"]
        strategy_used = dp.model.config.strategy_name  # "auto" resolved by the model
        summary["neighbor_list_builds"] = dp.strategy.rebuilds
        summary["load_imbalance"] = dp.model.load_imbalance
        summary.update(force_call_summary(dp.model))
    if rank != 0:
        return None
    conserved = end.num_atoms == full.num_atoms and torch.equal(
        end.atom_ids.cpu(), torch.sort(full.atom_ids.cpu()).values
    )
    summary.update(
        ranks=manager.world_size,
        strategy=strategy_used,
        grid="x".join(str(g) for g in grid) if grid else "auto",
        atoms_conserved=bool(conserved),
        max_force_diff_eV_per_A=force_diff,
    )
    return summary


def _default_spec(model, config):
    """The model's own spec for the strategy; for graph partition a model without one gets
    the plain node-partition preset (halo and sharded infer theirs in the core)."""
    from mlipdd.spec.presets import SPEC_MPNN_GP

    if config.strategy_name != "graph_partition" or model.distribution_spec(config.strategy) is not None:
        return None
    return SPEC_MPNN_GP


def _first_step_force_difference(dp, model, full) -> float | None:
    """Rank 0: the unchanged model on the full system vs the gathered distributed forces."""
    gathered = dp.gather()
    if gathered is None:
        return None
    with torch.no_grad():
        reference = model(full.clone(), compute_stress=False)["forces"].detach()
    order = torch.argsort(full.atom_ids)
    return float((gathered.forces - reference[order]).abs().max())

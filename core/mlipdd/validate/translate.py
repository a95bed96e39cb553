"""Error translator: a generic failure becomes a one-line diagnosis plus the fix.

Each pattern is a small function ``(message, context) -> (diagnosis, next_action) | None``
tried in order; the first that recognises the message wins. ``context`` carries what
the validator knows besides the message (opaque ops seen, whether the reference ran).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlipdd.validate.op_trace import op_attribute_path
from mlipdd.validate.strategies import strategy_preset

_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure|Warning|Interrupt|Refusal)[\w]*): (.*)$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')

# frames that belong to the machinery, not to the model under validation
_MACHINERY = ("/torch/", "/mlipdd/shard/", "/mlipdd/distributed/", "/mlipdd/testing/spawn",
              "/mlipdd/testing/conformance", "/mlipdd/validate/", "/mlipdd/models/base.py",
              "/mlipdd/strategy/", "multiprocessing/")


@dataclass
class Context:
    opaque_ops: list[str] = field(default_factory=list)
    where: str = ""  # "file:line (code)" of the model frame that raised, when known
    strategy: str = "halo"  # the strategy the ranks ran


def _pair(diagnosis: str, next_action: str) -> tuple[str, str]:
    return diagnosis, next_action


def exception_line(text: str) -> str:
    """The last ``SomeError: message`` line of a traceback (the text itself otherwise)."""
    found = [line for line in text.strip().splitlines() if _EXCEPTION_LINE.match(line)]
    return found[-1].strip() if found else text.strip().splitlines()[-1].strip() if text.strip() else ""


def _is_machinery(path: str) -> bool:
    standard_library = "/lib/python3" in path and "-packages/" not in path
    return standard_library or any(part in path for part in _MACHINERY)


def model_frame(text: str) -> str:
    """``file:line (code)`` of the innermost traceback frame outside torch, the standard
    library and mlipdd's core: where in the model the error surfaced."""
    lines = text.splitlines()
    where = ""
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if match and not _is_machinery(match.group(1)):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f"{match.group(1).rsplit('/', 1)[-1]}:{match.group(2)} ({code})"
    return where


def origin_traceback(failures: dict[int, str]) -> str:
    """The traceback of the rank where the error started (others re-raise it as remote)."""
    ordered = [text for _, text in sorted(failures.items())]
    own = [text for text in ordered if "RemoteRankError" not in exception_line(text)]
    return (own or ordered)[0] if ordered else ""


def failure_line(failure) -> str:
    """One line for a `RankFailure`: the originating rank's exception."""
    return exception_line(origin_traceback(failure.failures))


_ATEN_REFUSAL = re.compile(r"aten dispatch refuses `([^`]+)` on distributed rows: (.*)$")


def _aten_refusal(message: str, ctx: Context):
    """An aten refusal names the op, why, the tensors (placement, shape, origin) and the fix;
    the diagnosis keeps all but the fix, with the model's line, and the fix is the next action."""
    match = _ATEN_REFUSAL.search(message)
    if match is None:
        return None
    op, rest = match.groups()
    body, _, fix = rest.rpartition(" Fix: ")
    if not body:
        body, fix = rest, ""
    why, _, arguments = body.partition(". Arguments: ")
    where = f" at {ctx.where}" if ctx.where else ""
    seen = f" (arguments: {arguments.rstrip('.')})" if arguments else ""
    dotted = op.replace("::", ".")
    custom = [name for name in ctx.opaque_ops if dotted in (name.replace("::", "."), name.replace("::", ".").rpartition(".")[0])]
    diagnosis = f"the aten dispatch refused `{custom[0] if custom else op}`{where} on every rank: {why.rstrip('.')}{seen}"
    if custom:  # a custom op: the advice writes its OpAdapter out
        return _pair(diagnosis, opaque_op_advice(custom)[1])
    return _pair(diagnosis, f"{fix.rstrip('.') or 'rewrite that step with ops that have a rule'}; then re-validate")


def _non_finite_input(message: str, ctx: Context):
    if not re.search(r"NaN|\binf\b", message) or "position" not in message.lower():
        return None
    return _pair(
        "the sample batch holds NaN/inf positions (or atoms outside a non-periodic box)",
        "pass a sample_batch with finite positions inside the cell",
    )


def _non_finite_output(message: str, ctx: Context):
    if not re.search(r"NaN|non-finite|\binf\b", message):
        return None
    return _pair(
        "the distributed outputs are NaN/inf while the single-process run is finite",
        "check divisions by per-system counts computed from len(batch) or positions.shape[0], "
        "which differ per rank",
    )


def _unknown_element(message: str, ctx: Context):
    low = message.lower()
    if not re.search(r"atomic number|element|species", low):
        return None
    if not re.search(r"unknown|no |not supported|unsupported|missing|not in|invalid", low):
        return None
    return _pair(
        "the sample batch contains elements the model does not support",
        "pass sample_batch with supported species, e.g. "
        "mlipdd.testing.systems.triclinic(species=(...)) with the model's atomic numbers",
    )


def _cutoff(message: str, ctx: Context):
    if "cutoff" not in message.lower():
        return None
    return _pair(
        f"cutoff problem: {message}",
        "give the model a positive `cutoff` (model_config.neighbor_config.cutoff) that covers "
        "its largest interaction range; DomainConfig must use the model's cutoff",
    )


def _wrong_policy(message: str, ctx: Context):
    match = re.search(r"does not fit the (\w+) strategy", message)
    if match is None:
        return None
    strategy = match.group(1)
    preset = strategy_preset(strategy)
    fits = f"a spec made for it (e.g. mlipdd.spec.{preset[0]})" if preset else "a spec made for it"
    return _pair(
        f"the spec's storage policy does not fit the {strategy} strategy the ranks ran",
        f"use {fits}, or validate under the strategy the spec was written for (strategy= / --strategy)",
    )


def _unknown_strategy(message: str, ctx: Context):
    if "unknown strategy" not in message:
        return None
    return _pair(message.partition(": ")[2] or message,
                 "pass strategy='halo', 'sharded' or 'graph_partition' (--strategy on the command line)")


def _rows_out_of_bounds(message: str, ctx: Context):
    if ctx.strategy == "halo" or not re.search(r"out of bounds for dimension 0", message):
        return None
    where = f" at {ctx.where}" if ctx.where else ""
    return _pair(
        f"the model indexed a per-atom tensor past the rows this rank stores{where}; under "
        f"{ctx.strategy} storage a rank holds only its owned rows, so a tensor sized by a count "
        "(len(batch), n_atoms) and read by sender index reaches rows of other ranks",
        "create per-atom state from an input tensor (torch.zeros_like(batch.positions[:, :1]), "
        "positions.new_zeros(...)) so the dispatch knows its layout, then re-validate; or "
        "validate under strategy='halo'",
    )


def _partition_unaware(message: str, ctx: Context):
    if "without asking for its node partition" not in message:
        return None
    return _pair(
        "the model ran under graph partition without using the partition helpers, so each "
        "rank computed the whole system",
        "call mlipdd.shard.graph_partition's keep_owned_receivers, gather_nodes, local_receivers "
        "and sum_over_ranks in the model (see mlipdd.testing.graph_building_model; each is the "
        "identity in one process), or validate under strategy='halo' or 'sharded'",
    )


def _hang(message: str, ctx: Context):
    if "no result within" not in message:
        return None
    return _pair(
        "a rank never finished: usually a collective reached on some ranks only",
        "make every rank run the same ops: no data-dependent branch around a sum or scatter "
        "(e.g. `if mask.any():` on per-rank data), no early return on an empty subdomain",
    )


def _opaque_op(message: str, ctx: Context):
    if not ctx.opaque_ops:
        return None
    return opaque_op_advice(ctx.opaque_ops)


def opaque_op_advice(opaque_ops: list[str]) -> tuple[str, str]:
    names = ", ".join(opaque_ops)
    first = op_attribute_path(opaque_ops[0])
    return _pair(
        f"the model calls opaque custom op(s) {names}; ShardTensor dispatch cannot see inside "
        "them, so per-atom results they accumulate miss the other ranks' contributions",
        f"add OpAdapter(op={first}, output_transforms={{0: ScatterOutputs()}}) to the spec's "
        "DistributionSpec.custom_ops (one per op; pick the transform that fits each output), "
        "then re-validate",
    )


def _unknown_model(message: str, ctx: Context):
    if "unknown model" not in message:
        return None
    return _pair(
        f"no such model: {message.partition(': ')[2] or message}",
        "use a registered model name (`mlipdd plugins` lists them) or install the plugin that provides it",
    )


PATTERNS = (_unknown_model, _unknown_strategy, _aten_refusal, _non_finite_input, _non_finite_output,
            _unknown_element, _cutoff, _wrong_policy, _partition_unaware, _rows_out_of_bounds, _hang, _opaque_op)


def translate(message: str, ctx: Context | None = None, *, stage: str = "distributed run") -> tuple[str, str]:
    """``(diagnosis, next_action)`` for an error message; a generic pair when none matches."""
    ctx = ctx or Context()
    line = exception_line(message)
    for pattern in PATTERNS:
        found = pattern(line, ctx)
        if found is not None:
            return found
    where = f" at {ctx.where}" if ctx.where else ""
    return _pair(
        f"the {stage} raised{where}: {line}",
        "fix the error above; if the model runs fine single-process, look for code that assumes "
        "it sees the whole system (len(batch), global atom indices, .item() on partial sums)",
    )

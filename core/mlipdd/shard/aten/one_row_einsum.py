"""``torch.einsum`` on a rank whose rows are a dimension of size 1, spelled shape-stably.

# NOTE [a single row]
The ShardTensor has this rank's LOCAL shape, and torch's einsum decomposes by shape: a
dimension of size 1 is a broadcast dimension to it, which it sets aside and views
together with others where a larger dimension would be batched (``"ni,nij->nj"`` on
``(1, 3)`` rows views ``(3, 1, 1)`` as ``(1, 1, 3)``). A rank holding one row (sharded
storage: it owns one atom; any storage: one edge) would run other views than its
peers, and no view rule can tell where its one row went (merged with the 3, or moved).

The placement says which dim holds the rows, so a size-1 row dim is still rows: above
autograd (in the torch-function mode the spatial strategies enter around the forward,
`mlipdd.shard.aten.counted.CountedReductions`) an einsum with such an operand is
spelled with ops whose rules follow the row dim by its index, whatever its size:
``permute`` / ``unsqueeze`` to one letter order, a broadcast ``mul`` per pair of
operands (left to right, as torch contracts them), and ``sum`` over each letter once no
later operand and not the output has it. A summed row letter is then one sum over the
rows, one all_reduce, as the peers' ``bmm`` / ``sum`` over the rows is (collectives stay
in step); the gradients are those ops' own, through the same rules (NOTE [aten
gradients]). Only the rank holding one row takes this path; its intermediate products
hold one row, so their size is that of the other operands.

Equations this does not spell (the sublist form, a letter repeated within one operand:
a diagonal) go to torch's einsum, whose views the view rule places or refuses by name.
"""

from __future__ import annotations

import string

import torch

from mlipdd.shard.aten.placement import Rows
from mlipdd.shard.aten.tensor import ShardTensor

_ELLIPSIS_LETTERS = string.ascii_uppercase + string.ascii_lowercase


def holds_a_single_row(operands) -> bool:
    """Some operand's rows are a dimension of size 1 (NOTE [a single row])."""
    return any(isinstance(t, ShardTensor) and isinstance(t._place, Rows) and t.shape[t._place.dim] == 1
               for t in operands)


def einsum_operands(args, kwargs):
    """``(equation, operands)`` of ``torch.einsum(equation, *operands)`` (or a list of
    operands); None for the sublist form and for keyword calls."""
    if kwargs or not args or not isinstance(args[0], str):
        return None
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    return args[0], list(operands)


def parse(equation: str, operands) -> tuple[list[str], str] | None:
    """Each operand's letters and the output's, the ellipsis spelled out with letters no
    term uses (aligned from the right, as torch broadcasts them); None where a letter
    repeats within a term (a diagonal) or the terms do not match the operands."""
    equation = equation.replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        return None
    used = set(equation) - set(".,->")
    spare = [c for c in _ELLIPSIS_LETTERS if c not in used]
    widths = []
    for term, t in zip(terms, operands):
        if "..." in term:
            widths.append(t.dim() - len(term.replace("...", "")))
            if widths[-1] < 0:
                return None
        elif len(term) != t.dim():
            return None
    width = max(widths, default=0)
    if width > len(spare):
        return None
    dots = "".join(spare[:width])
    spelled = [term.replace("...", dots[width - w:] if w else "") if "..." in term else term
               for term, w in zip(terms, _widths_by_term(terms, widths))]
    if arrow:
        output = out.replace("...", dots)
    else:  # implicit output: the ellipsis, then the letters that occur once, in order
        counts = {}
        for term in spelled:
            for c in term:
                counts[c] = counts.get(c, 0) + 1
        output = dots + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in dots))
    if any(len(set(term)) != len(term) for term in spelled + [output]) or not set(output) <= set("".join(spelled)):
        return None
    return spelled, output


def _widths_by_term(terms, widths):
    it = iter(widths)
    return [next(it) if "..." in term else 0 for term in terms]


def one_row_einsum(terms: list[str], output: str, operands):
    """NOTE [a single row]: the einsum as broadcast products and sums, pair by pair."""
    operands = list(operands)
    rows = {term[t._place.dim] for term, t in zip(terms, operands)
            if isinstance(t, ShardTensor) and isinstance(t._place, Rows)}
    letters, acc = terms[0], operands[0]
    acc, letters = _sum_out(acc, letters, _needed(terms[1:], output))
    for k in range(1, len(operands)):
        right, right_letters = _sum_out(operands[k], terms[k], _needed(terms[k + 1:], output) | set(letters))
        union = letters + "".join(c for c in right_letters if c not in letters)
        union = "".join(sorted(union, key=lambda c: c not in rows))  # the rows first: see _aligned
        acc = _aligned(acc, letters, union) * _aligned(right, right_letters, union)
        acc, letters = _sum_out(acc, union, _needed(terms[k + 1:], output))
    return acc.permute([letters.index(c) for c in output]) if letters != output else acc


def _needed(later_terms, output) -> set:
    return set(output).union(*[set(t) for t in later_terms])


def _sum_out(t, letters: str, keep: set):
    """``t`` summed over its letters that ``keep`` lacks (one sum: over the rows, one all_reduce)."""
    gone = [d for d, c in enumerate(letters) if c not in keep]
    if not gone:
        return t, letters
    return t.sum(gone), "".join(c for c in letters if c in keep)


def _aligned(t, letters: str, union: str):
    """``t`` with its dims in ``union``'s order, a size-1 dim for each letter it lacks after
    its first; the leading ones it lacks are left to broadcasting. The row letters lead
    the union, so an operand without rows (a weight) is broadcast over them: its
    gradient is then a sum over the rows (one all_reduce, as the peers' ``mm``), where an
    ``unsqueeze`` would give it a ``squeeze`` of the row dim, which the rules refuse."""
    present = [c for c in union if c in letters]
    if present != list(letters):
        t = t.permute([letters.index(c) for c in present])
    first = union.index(present[0]) if present else len(union)
    for d, c in enumerate(union):
        if d > first and c not in letters:
            t = t.unsqueeze(d - first)
    return t

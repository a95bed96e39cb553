"""THE table of row-local aten ops: ops that compute each row from that row alone.

# NOTE [refuse by default]
An aten op with a distributed-rows argument runs only through a rule: its own rule in
`mlipdd.shard.aten.rules` (views, reductions, index reads, scatters, matmul), or,
for the ops named here, the row-local rule (operands aligned on the rows, shares summed
first unless the op is linear in them). Any other op raises `AtenRefusal` on every rank,
naming the op, the tensors' placements and origins, and the fix. A user declares more
row-local ops with `declare_row_local` (documented in the README): only an op whose
output row ``i`` depends on input rows ``i`` alone, elementwise over broadcast operands.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

_POINTWISE = """
abs acos acosh add addcdiv addcmul asin asinh atan atan2 atanh bitwise_and bitwise_not bitwise_or
bitwise_xor ceil clamp clamp_max clamp_min copysign cos cosh div elu elu_backward eq erf erfc erfinv exp
exp2 expm1 fill floor floor_divide fmod frac ge gelu gelu_backward gt hardtanh hardtanh_backward hypot
isfinite isinf isnan le leaky_relu leaky_relu_backward lerp log log10 log1p log2 log_sigmoid_forward
logical_and logical_not logical_or logical_xor lt masked_fill maximum minimum mish mul nan_to_num ne neg
pow reciprocal relu remainder round rsqrt sgn sigmoid sigmoid_backward sign silu silu_backward sin sinh
softplus softplus_backward sqrt square sub tan tanh tanh_backward threshold threshold_backward trunc
where xlogy logit mish_backward rsub sinc
"""

# linear in each distributed operand: shares stay shares (no exchange before the op)
_LINEAR = {"add", "sub", "neg", "mul", "div", "clone", "alias", "_to_copy", "detach", "rsub"}


def _packets(names: str) -> set:
    out = set()
    for name in names.split():
        for variant in (name, name + "_"):
            packet = getattr(aten, variant, None)
            if packet is not None:
                out.add(packet)
    return out


ROW_LOCAL = _packets(_POINTWISE)
COPIES = _packets("clone alias _to_copy detach lift_fresh")  # the values (an index's meaning) survive
LINEAR = {p for p in ROW_LOCAL | COPIES if p.__name__.rstrip("_") in _LINEAR}
USER_ROW_LOCAL: set = set()


def declare_row_local(*ops) -> None:
    """Declare aten ops row-local (``"aten::my_op"``, ``torch.ops.aten.my_op`` or an op of a
    custom library, ``torch.ops.mylib.op``): output row ``i`` depends on input rows ``i``
    alone, elementwise over broadcast operands. A wrong declaration is a wrong answer:
    declare only what is true."""
    for op in ops:
        if isinstance(op, str):
            ns, _, name = op.partition("::")
            op = getattr(getattr(torch.ops, ns), name)
        USER_ROW_LOCAL.add(getattr(op, "overloadpacket", op))


def is_row_local(func) -> bool:
    packet = func.overloadpacket
    return packet in ROW_LOCAL or packet in COPIES or packet in USER_ROW_LOCAL

"""Host reads and factories of the aten ShardTensor, in one process (no ranks needed).

NOTE [host reads of a ShardTensor]: ``.tolist()`` / ``.numpy()`` of a replicated value is its
value, of rows a refusal naming the fix; NOTE [aten factories] / [internal factories]: a plain
tensor's ``new_zeros`` / ``zeros_like`` is a replicated ShardTensor while the model runs, and
stays plain in mlipdd's own code.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.shard.aten import GHOSTED, REPLICATE, AtenRefusal, HaloContext, Rows, ShardTensor
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.shard.aten.factories import factory_rows
from mlipdd.shard.internal import internal_scope

CTX = HaloContext(plan=OwnedRowsOnly(3), n_edges=0)


def test_a_replicated_value_reads_as_its_list():
    counts = ShardTensor(torch.tensor([2, 1]), REPLICATE, CTX, "aten::bincount")
    assert counts.tolist() == [2, 1]
    assert counts.numpy().tolist() == [2, 1]


@pytest.mark.parametrize("read", ["tolist", "numpy"])
def test_rows_read_on_the_host_are_refused_by_name(read):
    z = ShardTensor(torch.tensor([1, 8, 8]), Rows(0, GHOSTED), CTX, "atomic_numbers")
    with pytest.raises(AtenRefusal, match=rf"refuses `Tensor.{read}` on Rows.*from `atomic_numbers`.*Fix: reduce"):
        getattr(z, read)()


def test_new_tensors_of_a_plain_one_are_replicated_except_in_mlipdd_code():
    weight = torch.nn.Parameter(torch.ones(4))
    with factory_rows(CTX):
        made = [weight.new_zeros(3), torch.zeros_like(weight), weight.new_full((2,), 1.0), torch.ones_like(weight)]
        with internal_scope():
            plain = [weight.new_empty(3), torch.zeros_like(weight), torch.zeros(2)]
    assert all(isinstance(t, ShardTensor) and t.placement == REPLICATE for t in made)
    assert not any(isinstance(t, ShardTensor) for t in plain)

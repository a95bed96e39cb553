"""MLIPSpec.output_kinds drives consolidation (strategy/outputs.py): per-graph and global
outputs stay as they are even when their row count looks per-atom, per-node and
undeclared ones get the strategy's row rule, partials named in all_reduce_outputs are
summed. Single process (the sum over one rank is the identity), so this pins the
routing; the distributed sums are covered by the strategies' conformance tests."""

import torch
from mlipdd.spec import SPEC_MPNN_HALO, OutputKind
from mlipdd.strategy.outputs import consolidate_outputs

N_ROWS = 4  # the rank's padded rows; the "per-graph" output below has as many systems


def test_output_kinds_route_each_output():
    spec = SPEC_MPNN_HALO.replace(
        output_kinds={**SPEC_MPNN_HALO.output_kinds, "dipoles": OutputKind.PER_GRAPH,
                      "total": OutputKind.GLOBAL}
    )
    seen = []

    def keep_owned_rows(name, value):
        seen.append(name)
        return value[:2] if value.shape[0] == N_ROWS else value

    outputs = {
        "energy": torch.ones(N_ROWS),  # per graph: 4 systems, as many as the rows
        "dipoles": torch.ones(N_ROWS, 3),  # per graph, declared by this spec
        "total": torch.ones(N_ROWS),  # global
        "forces": torch.ones(N_ROWS, 3),  # per node
        "charges": torch.ones(N_ROWS),  # not declared: decided by its rows
        "stress": torch.ones(N_ROWS, 3, 3),  # a per-rank partial (all_reduce_outputs)
        "label": "not a tensor",
    }
    result = consolidate_outputs(outputs, spec, None, keep_owned_rows)
    assert sorted(seen) == ["charges", "forces"]
    assert result["energy"].shape == (N_ROWS,) and result["dipoles"].shape == (N_ROWS, 3)
    assert result["total"].shape == (N_ROWS,)
    assert result["forces"].shape == (2, 3) and result["charges"].shape == (2,)
    assert result["stress"].shape == (N_ROWS, 3, 3) and result["label"] == "not a tensor"

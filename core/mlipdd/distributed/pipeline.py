"""`DistributedPipelineModel`: several models, one halo.

The halo (plan, ghost rows, local neighbour list) is built once from the largest
member cutoff and every block reads the same padded batch; the members' specs are
merged with ``|`` (composition table in the README) and each block's outputs are
summed by the pipeline before one consolidation.
"""

from __future__ import annotations

from mlipdd.data import InputError
from mlipdd.distributed.config import DomainConfig
from mlipdd.distributed.model import DistributedModel
from mlipdd.models.pipeline import PipelineModelWrapper


class DistributedPipelineModel(DistributedModel):
    def __init__(self, pipeline: PipelineModelWrapper, config: DomainConfig, spec=None, group=None):
        if not isinstance(pipeline, PipelineModelWrapper):
            raise InputError(
                f"DistributedPipelineModel needs a PipelineModelWrapper, got {type(pipeline).__name__}; "
                "use DistributedModel for a single model"
            )
        super().__init__(pipeline, config, spec=spec, group=group)

    @property
    def blocks(self):
        return self.model.models

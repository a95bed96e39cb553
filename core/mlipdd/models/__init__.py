from mlipdd.models.base import (
    ModelConfig,
    ModelWrapper,
    NeighborConfig,
    capturing,
    energy_forces_stress,
    per_system_sum,
)

__all__ = ["ModelConfig", "ModelWrapper", "NeighborConfig", "capturing", "energy_forces_stress",
           "per_system_sum"]

# reference model and model composition
from mlipdd.models.lj import LennardJones
from mlipdd.models.pipeline import PipelineModelWrapper

__all__ += ["LennardJones", "PipelineModelWrapper"]

from mlipdd.models.base import (
    ModelConfig,
    ModelWrapper,
    NeighborConfig,
    NeighborListFormat,
    energy_forces_stress,
    per_system_sum,
)

__all__ = [
    "ModelConfig",
    "ModelWrapper",
    "NeighborConfig",
    "NeighborListFormat",
    "energy_forces_stress",
    "per_system_sum",
]

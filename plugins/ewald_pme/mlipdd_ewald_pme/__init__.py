"""mlipdd plugin: Ewald, particle-mesh Ewald and damped-shifted-force electrostatics as
mlipdd model wrappers (charges from the batch or from an upstream charge model)."""

__version__ = "0.1.0"

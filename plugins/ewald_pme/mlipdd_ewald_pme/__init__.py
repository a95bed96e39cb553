"""mlipdd plugin: Ewald and particle-mesh-Ewald long-range electrostatics as an mlipdd model component.

Skeleton package; its content lands in its own issue.
"""

__version__ = "0.1.0"

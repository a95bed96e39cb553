"""mlipdd plugin: AIMNet2 models (charge-aware, with long-range Coulomb).

Skeleton package; its content lands in its own issue.
"""

__version__ = "0.1.0"

"""mlipdd plugin: Meta's UMA models (fairchem-core `eSCNMD` backbone).

Skeleton package; its content lands in its own issue.
"""

__version__ = "0.1.0"

"""An adversarial zoo of small potentials, one idiom of ordinary MLIP code each.

Each model is written the single-process way (SchNet/PaiNN/DimeNet/GAT/AIMNet/MEGNet/
TorchANI-like plain torch), never shaped to fit mlipdd. `classify` runs every model on
one process and on 2, 3 and 4 spawned gloo ranks under halo and sharded storage, on a
triclinic cell, a cell where a rank sees its own images and a slab cut along its
vacuum, and says per case whether the distributed run is ``exact`` (energy, forces and
stress within 1e-10 relative of one process), ``refused`` (an error on the ranks) or
``WRONG`` (a silently different answer). ``python -m mlipdd.testing.idiom_zoo`` prints
the table; docs/idiom_zoo.md holds the committed one.

Themes: `controls` (plainly supported; should be exact), `views` (reductions over the
atom rows through views and library calls), `rows` (rows picked, ordered or counted),
`segments` (aggregations without index_add, per-system pooling), `geometry` (triplets,
dense charge equilibration, own forces, own graph), `opaque` (TorchScript,
autograd.Function, custom ops).
"""

from __future__ import annotations

from mlipdd.testing.idiom_zoo.classifier import (
    OUTCOMES,
    STRATEGIES,
    SYSTEMS,
    CaseResult,
    classify,
    markdown_table,
)
from mlipdd.testing.idiom_zoo.controls import CONTROLS
from mlipdd.testing.idiom_zoo.geometry import GEOMETRY
from mlipdd.testing.idiom_zoo.opaque import OPAQUE
from mlipdd.testing.idiom_zoo.rows import ROWS
from mlipdd.testing.idiom_zoo.segments import SEGMENTS
from mlipdd.testing.idiom_zoo.views import VIEWS

THEMES = {"controls": CONTROLS, "views": VIEWS, "rows": ROWS, "segments": SEGMENTS, "geometry": GEOMETRY,
          "opaque": OPAQUE}
ZOO = {cls.__name__: cls for models in THEMES.values() for cls in models}
"""model name -> class (a module-level callable that builds the model with no arguments)."""

__all__ = ["OUTCOMES", "STRATEGIES", "SYSTEMS", "THEMES", "ZOO", "CaseResult", "classify", "markdown_table"]

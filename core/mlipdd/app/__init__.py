"""The run application, the top layer: `mlipdd run`'s settings (`RunConfig`), building the
model, system and integrator, one process (`run_simulation`) or several ranks
(`mlipdd.app.launch`), and the run summary. It goes down through the library (models,
dynamics, distributed); nothing in the library imports it."""

from mlipdd.app.simulation import RunConfig, format_summary, run_simulation

__all__ = ["RunConfig", "format_summary", "run_simulation"]

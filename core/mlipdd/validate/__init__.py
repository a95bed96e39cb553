"""Validation of a model under domain decomposition, and the spec that makes it right.

``trace_and_validate(model_factory, sample_batch, world_size=2)`` runs the model once
single-process (the truth, with an op trace), then on spawned ranks with a candidate
spec, compares every output, repairs the spec with the auto-fix rules when a symptom is
recognised, and explains errors. ``report.ok`` -> ``report.spec.save(path)``; otherwise
``report.next_action`` says what to change.
"""

from mlipdd.validate.autofix import AUTOFIX_RULES, describe_change
from mlipdd.validate.coverage import RankView, default_sample
from mlipdd.validate.op_trace import OpTrace
from mlipdd.validate.report import Attempt, OutputDiff, ValidationReport
from mlipdd.validate.runner import trace_and_validate
from mlipdd.validate.translate import translate

__all__ = ["AUTOFIX_RULES", "Attempt", "OpTrace", "OutputDiff", "RankView", "ValidationReport",
           "default_sample", "describe_change", "trace_and_validate", "translate"]

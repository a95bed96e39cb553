"""A small real module for the spec-layer tests: classes and helpers to patch, and
module-level replacements that a spec file can name."""

from __future__ import annotations

import warnings

import torch


class Base:
    def energy(self, x):
        return x + 1

    def label(self):
        return "base"


class Child(Base):
    def energy(self, x):
        return x + 10


def helper(x):
    return x * 2


def calls_helper(x):
    # a bare name inside the module: sees a PythonAdapter swap of `helper`
    return helper(x)


def _times_3(x: torch.Tensor) -> torch.Tensor:
    return x * 3


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated
    scripted_helper = torch.jit.script(_times_3)


# ---- replacements -------------------------------------------------------------------------


def energy_times_100(original, self, x):
    return original(self, x) * 100


def energy_plus_5(original, self, x):
    return original(self, x) + 5


def label_patched(original, self):
    return "patched:" + original(self)


def raising_energy(original, self, x):
    raise RuntimeError("boom")


def helper_negated(x):
    return -x


def helper_plus_one(original, x):
    return original(x) + 1


def scripted_replacement(x):
    return x * 0 - 1

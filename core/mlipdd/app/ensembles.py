"""``--ensemble``: the integrator or optimiser of a run, built from its settings."""

from __future__ import annotations

from mlipdd.dynamics import FIRE, FIRE2, NPH, NPT, NVE, NoseHoover, NVTLangevin

ENSEMBLES = {
    "nve": "constant energy (velocity Verlet)",
    "nvt": "Langevin thermostat (--temperature, --friction)",
    "nh": "Nose-Hoover chain thermostat (--temperature, --tdamp)",
    "npt": "MTK barostat + Nose-Hoover chain (--temperature, --pressure, --tdamp, --pdamp)",
    "nph": "MTK barostat, no thermostat (--pressure, --pdamp)",
    "fire": "FIRE relaxation of the positions, stops at --fmax",
    "fire2": "FIRE 2.0 relaxation of the positions, stops at --fmax",
}
OPTIMISERS = ("fire", "fire2")


def build_dynamics(cfg, model, hooks=()):
    """The integrator for ``cfg.ensemble``; damping times default to 100 (thermostat) and
    1000 (barostat) time steps."""
    dt, skin = cfg.dt, cfg.skin
    tdamp = cfg.tdamp if cfg.tdamp is not None else 100.0 * dt
    pdamp = cfg.pdamp if cfg.pdamp is not None else 1000.0 * dt
    ensemble = cfg.ensemble
    if ensemble == "nve":
        return NVE(model, dt, hooks, skin=skin)
    if ensemble == "nvt":
        return NVTLangevin(model, dt, cfg.temperature, cfg.friction, cfg.seed, hooks, skin=skin)
    if ensemble == "nh":
        return NoseHoover(model, dt, cfg.temperature, tdamp, hooks=hooks, skin=skin)
    if ensemble == "npt":
        return NPT(model, dt, cfg.temperature, cfg.pressure, tdamp, pdamp, hooks, skin=skin)
    if ensemble == "nph":
        return NPH(model, dt, cfg.pressure, pdamp, hooks, skin=skin)
    optimiser = FIRE if ensemble == "fire" else FIRE2
    return optimiser(model, dt, fmax=cfg.fmax, hooks=hooks, skin=skin)

"""The summary ``mlipdd run`` prints at the end, as text (``--json`` prints the dict).

MD reports speed in ns/day, the drift of the conserved energy and the temperature; a
relaxation (fire, fire2) reports what an optimiser's user asks: converged or not, after
how many steps, the final largest force and the final energy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def format_summary(summary: Mapping[str, Any]) -> str:
    s = summary
    body = _relaxation_lines(s) if "converged" in s else _md_lines(s)
    return "\n".join([*body, *_force_call_lines(s), *_distributed_lines(s)])


def _force_call_lines(s: Mapping[str, Any]) -> list[str]:
    """Which force call ran (set by runs through DomainParallel), with its counters."""
    if "force_call" not in s:
        return []
    line = f"  force call   {s['force_call']}"
    stats = s.get("compile")
    if stats:
        line += (f": {stats['compiles']} compile(s), {stats['recompiles']} after the first, "
                 f"{stats['compile_seconds']:.1f} s compiling, caps {stats['caps']} (atoms, edges), "
                 f"{stats['checks']} eager check(s)")
    elif "cuda_graph_captures" in s:
        line += f": {s['cuda_graph_captures']} capture(s)"
    return [line]


def _md_lines(s: Mapping[str, Any]) -> list[str]:
    drift_label = "energy drift" if s["ensemble"] == "nve" else "conserved-energy drift (incl. bath)"
    return [
        (f"{s['ensemble'].upper()} {s['model']} on {s['system']}: {s['n_atoms']} atoms, "
         f"{s['steps']} steps of {s['dt_fs']} fs ({s['dtype']}, {s['device']})"),
        (f"  speed        {s['steps_per_s']:.2f} steps/s, {s['atom_steps_per_s']:.3g} atom-steps/s, "
         f"{s['ns_per_day']:.3g} ns/day ({s['wall_s']:.2f} s)"),
        (f"  {drift_label}: {s['energy_drift_meV_per_atom']:+.4f} meV/atom "
         f"({s['energy_drift_meV_per_atom_per_ps']:+.4f} meV/atom/ps)"),
        f"  temperature  final {s['temperature_final_K']:.1f} K, mean {s['temperature_mean_K']:.1f} K",
        _files_line(s),
    ]


def _relaxation_lines(s: Mapping[str, Any]) -> list[str]:
    state = "converged" if s["converged"] else "NOT converged"
    steps = "step" if s["steps"] == 1 else "steps"
    lines = [
        (f"{s['ensemble'].upper()} {s['model']} on {s['system']}: {s['n_atoms']} atoms, {state} "
         f"to fmax {s['fmax_eV_per_A']:g} eV/A after {s['steps']} {steps} ({s['dtype']}, {s['device']})"),
        (f"  final        max |F| {s['fmax_final_eV_per_A']:.4g} eV/A, energy {s['energy_final_eV']:.6f} eV "
         f"({s['energy_final_eV'] / s['n_atoms']:.6f} eV/atom; {s['energy_change_eV']:+.6f} eV from the start)"),
        f"  speed        {s['steps_per_s']:.2f} steps/s ({s['wall_s']:.2f} s)",
        _files_line(s),
    ]
    if not s["converged"]:
        lines.append("  (more --steps, or check the structure: it did not reach --fmax)")
    return lines


def _files_line(s: Mapping[str, Any]) -> str:
    return f"  neighbour-list builds: {s['neighbor_list_builds']}" + (
        f"; trajectory: {s['trajectory']}" if s["trajectory"] else "")


def _distributed_lines(s: Mapping[str, Any]) -> list[str]:
    """Extra summary lines of a domain-decomposed run (keys set by mlipdd.app.launch)."""
    if "ranks" not in s:
        return []
    return [
        (f"  domain decomposition: {s['ranks']} ranks ({s['strategy']}, grid {s['grid']}); "
         f"atoms conserved: {'yes' if s['atoms_conserved'] else 'NO'}"),
        f"  first-step forces vs one process: max |dF| {s['max_force_diff_eV_per_A']:.3g} eV/A",
        *([f"  owned atoms per rank, max/mean at the last rebuild: {s['load_imbalance']:.3f}"]
          if s.get("load_imbalance") is not None else []),
    ]

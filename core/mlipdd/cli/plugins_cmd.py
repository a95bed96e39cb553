"""``mlipdd plugins``: what was discovered, with versions, and what failed to load."""

from __future__ import annotations

import argparse
import json

from mlipdd import plugins


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list installed plugins, their models and presets, and plugins that failed to load",
        description="List installed mlipdd plugins (entry-point group 'mlipdd') with versions, "
        "the models and presets they register, and plugins that failed to load.",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 if any plugin failed to load"
    )
    parser.add_argument(
        "--handlers", action="store_true",
        help="list the aten dispatch rules (module, ops, what they do)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.handlers:
        rules = handler_rows()
        print(json.dumps(rules, indent=2) if args.json else format_handlers(rules))
        return 0
    reg = plugins.registry()
    if args.json:
        print(json.dumps(as_dict(reg), indent=2))
    else:
        print(format_text(reg))
    return 1 if args.strict and reg.failed else 0


def as_dict(reg: plugins.Registry) -> dict:
    return {
        "autoload": not plugins.autoload_disabled(),
        "plugins": [info._asdict() for info in reg.plugins],
        "models": {
            name: {"plugin": entry.plugin, "description": entry.description}
            for name, entry in sorted(reg.models.items())
        },
        "presets": {name: reg.preset_plugins[name] for name in sorted(reg.presets)},
        "strategies": {
            name: {"plugin": entry.plugin, "description": entry.description, "class": _qualname(entry.cls)}
            for name, entry in sorted(reg.strategies.items())
        },
        "spec_modules": sorted(reg.spec_modules),
        "spec_patch_modules": sorted(reg.spec_patch_modules),
        "failed": [failure._asdict() for failure in reg.failed],
    }


def format_text(reg: plugins.Registry) -> str:
    autoload = "off" if plugins.autoload_disabled() else "on"
    lines = [f"Plugins ({len(reg.plugins)} loaded, entry-point autoload {autoload}):"]
    width = max([len(p.name) for p in reg.plugins] + [len(n) for n in reg.models] + [4])
    for info in reg.plugins:
        source = f"{info.dist} {info.version}" if info.dist else "(registered in-process)"
        lines.append(f"  {info.name:<{width}}  {source}")

    def entries(table):
        return [f"  {name:<{width}}  [{e.plugin}]" + (f"  {e.description}" if e.description else "")
                for name, e in sorted(table.items())]

    for title, rows in (("Models", entries(reg.models)),
                        ("Presets", [f"  {name}  [{reg.preset_plugins[name]}]" for name in sorted(reg.presets)]),
                        ("Strategies", entries(reg.strategies))):
        lines += [f"{title}:", *(rows or ["  (none)"])]
    lines.append(f"Spec modules: {', '.join(sorted(reg.spec_modules)) or '(none)'}")
    if reg.spec_patch_modules:
        lines.append(f"Spec modules, patch targets only: {', '.join(sorted(reg.spec_patch_modules))}")
    if reg.failed:
        lines.append("Failed plugins (skipped):")
        for failure in reg.failed:
            lines.append(f"  {failure.name}: {failure.error}")
    return "\n".join(lines)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def handler_rows() -> list[dict]:
    """The aten dispatch's rules (one per aten op: NOTE [aten precedence] in
    `mlipdd.shard.aten.rules`), each with the ops it takes and its docstring's first line."""
    from mlipdd.shard.aten import RULES

    ops_of: dict = {}
    for op, fn in RULES.items():
        ops_of.setdefault(fn, []).append(str(op))
    return [{"name": fn.__name__, "layout": fn.__module__.rpartition(".")[2], "ops": sorted(ops),
             "does": (fn.__doc__ or "").strip().split("\n")[0]} for fn, ops in ops_of.items()]


def format_handlers(rules: list[dict]) -> str:
    lines = ["aten dispatch rules, one per aten op (an op on distributed rows without one is refused;",
             "[module] = where the rule lives under mlipdd.shard.aten):"]
    for i, rule in enumerate(rules, 1):
        lines.append(f"  {i:>2}. {rule['name']:<26} [{rule['layout']}] {rule['does']}")
        lines.append(f"      ops: {', '.join(rule['ops'])}")
    return "\n".join(lines)

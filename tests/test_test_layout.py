"""`make test` collects tests/ and every plugins/*/tests in ONE pytest run, where two test
files with the same name clash ("import file mismatch") and stop the whole run."""

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_test_file_names_are_unique_across_core_and_plugins():
    seen = defaultdict(list)
    for folder in [ROOT / "tests", *sorted((ROOT / "plugins").glob("*/tests"))]:
        for path in folder.rglob("*.py"):
            if path.name.startswith("test_"):
                seen[path.name].append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename these test files so each name is unique (e.g. prefix the plugin): {clashes}"

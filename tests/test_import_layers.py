"""Which package may import which: the layers that must not form circles, read from the source
(so a late import inside a function counts too)."""
import ast
from pathlib import Path

import pytest

KILN = Path(__file__).resolve().parents[1] / "kiln"

# (package whose modules are checked, package they must not import, why)
RULES = [
    ("kiln/attention", "kiln.model", "attention backends serve the model's layers"),
    ("kiln/compilation/warm_start", "kiln.compilation.backend",
     "the backend owns its WarmStart and calls it; the warm start never calls back"),
    ("kiln/cudagraphs", "kiln.compilation.backend", "the backend wraps pieces for CUDA graphs"),
    ("kiln/cudagraphs", "kiln.worker", "the worker runs the capture step"),
    ("kiln/config", "kiln.compilation", "settings know nothing of the compile stack's state"),
    ("kiln/config", "kiln.cudagraphs", "the resolved graph mode is the model runner's"),
    ("kiln/config", "kiln.worker", "settings know nothing of the engine's state"),
]


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names (relative ones resolved
    against the file's package)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(KILN.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder, forbidden, why", RULES)
def test_no_import_against_the_layering(folder, forbidden, why):
    offenders = {}
    for path in sorted((KILN.parent / folder).rglob("*.py")):
        bad = sorted(m for m in imported_modules(path)
                     if m == forbidden or m.startswith(forbidden + "."))
        if bad:
            offenders[str(path.relative_to(KILN.parent))] = bad
    assert not offenders, f"{folder} must not import {forbidden} ({why}): {offenders}"

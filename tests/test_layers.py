"""Data flows down the layers only: ``pipeline`` -> ``workers`` -> ``operators``, never back up.

Parses every module's imports (module level and inside functions) without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what each layer must not import
FORBIDDEN = {"operators": ("pipeline", "workers"), "workers": ("pipeline",)}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_imports_up_the_layers(layer):
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for line, module in _imports(path):
            if module.split(".")[0] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports up the layers:\n" + "\n".join(bad)


def test_the_check_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from pipeline import __version__\n    import pipeline.mlflow_model\n")
    assert [m for _, m in _imports(f)] == ["pipeline", "pipeline.mlflow_model"]

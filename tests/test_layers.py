"""The layer rules: every import inside `jaxmech` obeys the rules block of BUILD_NOTES.md
("Import rules (tested)"), and the block covers every module."""

import ast
import fnmatch
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def rules() -> list[tuple[str, list[str]]]:
    """[(module pattern, [allowed or !forbidden patterns])] from BUILD_NOTES.md."""
    text = (REPO / "BUILD_NOTES.md").read_text()
    block = text.split("```import-rules\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.strip().splitlines():
        pattern, _, allowed = line.partition(":")
        out.append((pattern.strip(), allowed.split()))
    return out


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (REPO / "jaxmech").rglob("*.py"):
        parts = p.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(path: pathlib.Path, known) -> set[str]:
    """The jaxmech modules a file imports (at any depth: function-level imports too);
    `from pkg import name` counts as `pkg.name` where that is a module, else `pkg`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in known else node.module)
    return {m for m in out if m.split(".")[0] == "jaxmech"}


def allowed(target: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("!") and fnmatch.fnmatchcase(target, p[1:]):
            return False
        if fnmatch.fnmatchcase(target, p):
            return True
    return False


def rule_of(module: str, table) -> list[str] | None:
    return next((a for pattern, a in table if fnmatch.fnmatchcase(module, pattern)), None)


def test_every_import_obeys_the_layer_rules():
    table, known = rules(), modules()
    assert len(table) > 20, "the rules block of BUILD_NOTES.md was not found"
    uncovered = [m for m in known if rule_of(m, table) is None]
    assert not uncovered, f"modules without a layer rule in BUILD_NOTES.md: {uncovered}"
    broken = [
        f"{m} imports {t}"
        for m, path in sorted(known.items())
        for t in sorted(imports(path, known))
        if t != m and not allowed(t, rule_of(m, table))
    ]
    assert not broken, "imports that break the layer rules:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "module, target, ok",
    [
        ("jaxmech.reports.patching", "jaxmech.reports.steering", False),
        ("jaxmech.reports.patching", "jaxmech.reports.common", True),
        ("jaxmech.analysis.patching", "jaxmech.families.toy_vlm.model", False),
        ("jaxmech.analysis.patching", "jaxmech.data.scenes", False),
        ("jaxmech.families.toy_vlm.model", "jaxmech.families.dual_encoder.checks", False),
        ("jaxmech.models.attention", "jaxmech.data.scenes", False),
        ("jaxmech.data.scenes", "jaxmech.train", False),
    ],
)
def test_the_rules_refuse_what_the_layers_forbid(module, target, ok):
    assert allowed(target, rule_of(module, rules())) is ok

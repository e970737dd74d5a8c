"""The layer rules: every import inside `jaxmech` obeys `tests/layer_rules.txt`, and the
rules cover every module."""

import ast
import fnmatch
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def rules() -> list[tuple[str, list[str]]]:
    """[(module pattern, [allowed or !forbidden patterns])] from tests/layer_rules.txt."""
    text = (REPO / "tests" / "layer_rules.txt").read_text()
    out = []
    for line in text.strip().splitlines():
        if line.startswith("#"):
            continue
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
    """The allowed patterns of the first rule matching `module`, `{own}` filled in with
    its family package (`jaxmech.families.NAME`)."""
    own = ".".join(module.split(".")[:3])
    rule = next((a for pattern, a in table if fnmatch.fnmatchcase(module, pattern)), None)
    return None if rule is None else [p.replace("{own}", own) for p in rule]


def test_every_import_obeys_the_layer_rules():
    table, known = rules(), modules()
    assert len(table) > 20, "tests/layer_rules.txt holds too few rules"
    uncovered = [m for m in known if rule_of(m, table) is None]
    assert not uncovered, f"modules without a layer rule in tests/layer_rules.txt: {uncovered}"
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
        ("jaxmech.analysis.patching", "jaxmech.data.tasks.scenes", False),
        ("jaxmech.families.toy_vlm.model", "jaxmech.families.dual_encoder.checks", False),
        ("jaxmech.models.attention", "jaxmech.data.tasks.scenes", False),
        ("jaxmech.data.tasks.scenes", "jaxmech.train", False),
        ("jaxmech", "jaxmech.families.dual_encoder.model", False),
        ("jaxmech", "jaxmech.families.vlm_view", True),
        ("jaxmech.model", "jaxmech.families.qwen2_vl.load", False),
        ("jaxmech.families.registry", "jaxmech.families.llava.family", False),
        ("jaxmech.sweep.spec", "jaxmech.sweep.runs", False),
        ("jaxmech.reports.subjects", "jaxmech.cli", False),
        ("jaxmech.reports.subjects", "jaxmech.model", False),
        ("jaxmech.reports.runs", "jaxmech.cli", False),
        ("jaxmech.reports.checkpoints", "jaxmech.model", True),
        ("jaxmech.sweep.runs", "jaxmech.sweep.spec", True),
    ],
)
def test_the_rules_refuse_what_the_layers_forbid(module, target, ok):
    assert allowed(target, rule_of(module, rules())) is ok

"""The Colab notebook (`experiments/colab_seed_study.ipynb`) runs top to
bottom: its code cells are executed in order, as a user would, at the smallest sizes
(shell lines, `!` and `%`, are skipped: they install the package in Colab), with the
suite's tiny model, so its programs are those the other tiny tests compile."""

import json
import os

import matplotlib
import pytest
from conftest import TINY

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "experiments", "colab_seed_study.ipynb")


def code_cells(path: str) -> list[str]:
    """The code cells' Python, shell lines dropped."""
    with open(path) as f:
        nb = json.load(f)
    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = [ln for ln in cell["source"] if not ln.lstrip().startswith(("!", "%"))]
        out.append("".join(lines))
    return out


def test_the_notebook_runs_top_to_bottom_at_the_smallest_sizes(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = str(tmp_path / "study")
    monkeypatch.setenv("JAXMECH_NOTEBOOK_SIZE", "smallest")
    monkeypatch.setenv("JAXMECH_NOTEBOOK_OUT", out)
    monkeypatch.setenv("JAXMECH_NOTEBOOK_MODEL", json.dumps(TINY))
    monkeypatch.setattr(plt, "show", lambda *a, **k: plt.close("all"))
    cells = code_cells(NOTEBOOK)
    assert len(cells) >= 6 and any("decompose" in c for c in cells)
    ns: dict = {}
    for i, source in enumerate(cells):
        try:
            exec(compile(source, f"{NOTEBOOK}#cell{i}", "exec"), ns)
        except Exception as e:  # name the cell that failed
            pytest.fail(f"notebook code cell {i} raised {type(e).__name__}: {e}")
    # what the cells built: the grid's models trained and dissected
    assert len(ns["run"]["rows"]) == len(ns["grid"].settings) == 4
    assert os.path.exists(os.path.join(out, "figures", "curves.png"))
    assert float(ns["gap"]) < 1e-4  # the notebook's own check: the terms sum to the logits
    assert ns["terms"]["EP"].shape[0] == 4  # vmapped over the stacked models
    assert {"seen_acc", "unseen_acc"} <= set(ns["table"])

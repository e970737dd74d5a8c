"""The protocol study: grids, contrasts and verdicts, and one tiny study end to end."""

import os

import numpy as np
import pytest
from conftest import TINY as SHARED_TINY

from jaxmech.config import Config, ConfigError
from jaxmech.presets import BASELINE, BY_NAME, PROTOCOLS, Protocol
from jaxmech.reports.protocol import (
    cells_from,
    protocol_grid,
    run_study,
    trend,
    verdict,
    write_report,
)
from jaxmech.stats import diff_ci

TINY = dict(
    SHARED_TINY,
    layouts_per_pair=3,
    steps=20,
    eval_every=10,
)


def test_cells_are_two_axes_through_the_first_cell():
    assert cells_from([5, 10, 15], [15, 45]) == ((5, 15), (10, 15), (15, 15), (5, 45))
    assert cells_from([5], [15]) == ((5, 15),)


def test_every_protocol_builds_a_valid_grid():
    for p in PROTOCOLS:
        grid = protocol_grid(p, cells_from([5, 15], [15, 45]), seeds=2)
        assert len(grid.settings) == 6
        assert [s.n_pair_labels for s in grid.settings] == [5, 5, 15, 15, 5, 5]
        if grid.config.train.epochs:  # finite: program length from the largest budget
            assert grid.config.train.steps % grid.config.train.eval_every == 0
    assert BY_NAME["finite_e60"].overrides == {"epochs": 60}


def test_bad_protocol_or_cell_fails_naming_the_field():
    with pytest.raises(ConfigError, match="d_model"):
        protocol_grid(Protocol("x", "width", "x", {"d_model": 7}), ((5, 15),), seeds=1)
    with pytest.raises(ConfigError, match="layouts_per_pair"):
        protocol_grid(BASELINE, ((5, 99),), seeds=1)


def test_diff_ci_matches_welch_by_hand():
    a, b = [0.5, 0.6, 0.55, 0.65], [0.9, 1.0, 0.95, 0.97]
    d, lo, hi = diff_ci(a, b)
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 4
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 3)
    assert int(df) == 5
    half = 2.571 * np.sqrt(va + vb)  # t_{0.975, 5}
    np.testing.assert_allclose([d, lo, hi], [np.mean(b) - np.mean(a), d - half, d + half])


def _rows(cells_acc):
    rows = []
    for (p, q), accs in cells_acc.items():
        for a in accs:
            rows.append(
                {
                    "n_pair_labels": p,
                    "layouts_per_pair": q,
                    "diverged_step": -1,
                    "unseen_acc": a,
                    "steps_trained": 100 * p,  # a fixed-epoch protocol: steps follow N_pair
                }
            )
    return rows


def test_verdict_reads_the_two_contrasts():
    cells = ((5, 15), (15, 15), (5, 45))
    paper = _rows({(5, 15): [0.5, 0.55, 0.6, 0.52], (15, 15): [0.95, 0.97, 0.99, 0.96],
                   (5, 45): [0.52, 0.58, 0.55, 0.5]})  # fmt: skip
    v = verdict(trend(paper, cells))
    assert "paper's trend: **yes**" in v and "n_2 flat at chance" in v
    assert "steps 500 vs 1500: confounded with training length" in v
    layouts_help = _rows({(5, 15): [0.5, 0.55, 0.6, 0.52], (15, 15): [0.95, 0.97, 0.99, 0.96],
                          (5, 45): [0.95, 0.97, 0.99, 0.96]})  # fmt: skip
    v = verdict(trend(layouts_help, cells))
    assert "n_2 matters too" in v and "paper's trend: no" in v
    flat = _rows({(5, 15): [0.97, 0.99, 1.0, 0.98], (15, 15): [0.99, 1.0, 0.98, 1.0],
                  (5, 45): [0.99, 1.0, 0.97, 1.0]})  # fmt: skip
    assert "no clear N_pair effect" in verdict(trend(flat, cells))


# slow: a reproduction end to end (trains, analyses, reports, resumes; ~15 s); its trend and verdict arithmetic stay in the suite
@pytest.mark.slow
def test_tiny_study_trains_analyses_reports_and_resumes(tmp_path):
    """~20 s: trains (150 finite-set steps), dissects, reports and reruns a one-protocol
    study end to end (the finite-set segment, the ablation table and EP-gradient
    programs)."""
    base = Config().replace(**TINY)
    cells = ((3, 3), (5, 3))
    prots = [BY_NAME["finite_e20"]]  # the finite path; streaming sweeps are tested elsewhere
    lines = []
    # chunks of 2: the finite program of tests/test_finite.py (compiled once per session)
    merged = run_study(
        str(tmp_path), prots, cells, seeds=2, base=base, chunk_size=2, log=lines.append
    )
    for p in prots:
        rows = merged[p.name]
        assert len(rows) == 4
        for r in rows:  # accuracies, ablations and the EP gradient per model
            for key in ("unseen_acc", "unseen_ep", "unseen_ep+bp", "ep_slope", "steps_trained"):
                assert np.isfinite(r[key])
    # finite: 20 epochs over 3*2*3 and 5*4*3 pair items, 8 pair samples per batch
    assert sorted({r["steps_trained"] for r in merged["finite_e20"]}) == [45, 150]
    path = write_report(str(tmp_path), prots, merged, cells, 2, None)
    text = open(path).read()
    assert "## dataset" in text and "N_pair effect" in text and "n_2 axis not run" in text
    assert os.path.isfile(tmp_path / "figures" / "factor_dataset.png")
    # a second invocation trains nothing and reads the cached mechanism rows
    lines2 = []
    again = run_study(
        str(tmp_path), prots, cells, seeds=2, base=base, chunk_size=2, log=lines2.append
    )
    assert any("already finished" in line for line in lines2)
    assert again["finite_e20"][0]["unseen_ep"] == merged["finite_e20"][0]["unseen_ep"]

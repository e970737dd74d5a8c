"""The passing - failing comparison of a selected run's headline numbers
(`tables.Measure`, `compare_groups`, `fmt_difference`): per-model values read from
labelled table rows, their difference of means with a Welch 95% interval, and what a
side with no model or one model gives. The driver's use of it on a results folder is
`test_selection`'s."""

import math

import numpy as np
import pytest

from jaxmech.reports.tables import Measure, compare_groups, fmt_difference, group_difference


def _rows(values: dict, side: str, **labels) -> list[dict]:
    return [{"model": m, "model_group": side, **labels, "v": v} for m, vs in values.items()
            for v in vs]  # fmt: skip


def test_difference_and_welch_interval_by_hand():
    # model 1's value is the mean of its two rows; model 9's NaN row leaves it out
    passing = _rows({0: [0.9], 1: [0.7, 0.9], 2: [1.0]}, "passing", layer=1)
    failing = _rows({3: [0.2], 4: [0.5], 5: [0.3], 6: [0.1], 9: [math.nan]}, "failing", layer=1)
    other = _rows({0: [-5.0], 3: [5.0]}, "passing", layer=0)  # another layer: not mixed in
    got = compare_groups(
        {"t": passing + failing + other}, [Measure("m", "t", "v", (("layer", 1),))]
    )
    rec = got["all"]["m"]
    p, f = np.array([0.9, 0.8, 1.0]), np.array([0.2, 0.5, 0.3, 0.1])
    vp, vf = p.var(ddof=1) / 3, f.var(ddof=1) / 4
    df = (vp + vf) ** 2 / (vp**2 / 2 + vf**2 / 3)
    assert int(df) == 4  # Welch-Satterthwaite, rounded down
    half = 2.776 * math.sqrt(vp + vf)  # t_{0.975, 4}
    d = p.mean() - f.mean()
    np.testing.assert_allclose(
        [rec["difference"], rec["ci_low"], rec["ci_high"], rec["passing"], rec["failing"]],
        [d, d - half, d + half, p.mean(), f.mean()],
    )
    assert (rec["n_passing"], rec["n_failing"]) == (3, 4)
    assert fmt_difference(rec).endswith(f"{d:+.3f} [{d - half:+.3f},{d + half:+.3f}]")


def test_by_columns_and_question_sets_each_get_their_own_comparison():
    rows = []
    for e, shift in (("seen", 0.0), ("unseen", 10.0)):
        for g in ("image", "question"):
            rows += _rows({0: [shift + 1.0], 1: [shift + 3.0]}, "passing", examples=e, group=g)
            rows += _rows({2: [shift], 3: [shift + 2.0]}, "failing", examples=e, group=g)
    got = compare_groups({"t": rows}, [Measure("shift", "t", "v", by=("group",))])
    assert list(got) == ["seen", "unseen"]
    assert list(got["seen"]) == ["shift, group image", "shift, group question"]
    assert got["unseen"]["shift, group image"]["passing"] == 12.0
    assert got["seen"]["shift, group question"]["difference"] == 1.0


def test_a_side_with_no_model_or_one_model_says_so():
    empty = group_difference([0.5, 0.7], [math.nan])
    assert empty["n_failing"] == 0 and math.isnan(empty["difference"])
    assert math.isnan(empty["failing"])
    line = fmt_difference(empty)
    assert "failing empty (n = 0)" in line and "no difference" in line
    one = group_difference([0.5, 0.7], [0.1])
    assert one["n_failing"] == 1 and math.isclose(one["difference"], 0.5)
    assert math.isnan(one["ci_low"]) and math.isnan(one["ci_high"])
    assert "no interval (one model on a side)" in fmt_difference(one)
    # a measure only one group has rows for: the other side is empty, not dropped
    got = compare_groups({"t": _rows({0: [1.0]}, "passing")}, [Measure("m", "t", "v")])
    assert got["all"]["m"]["n_failing"] == 0


def test_a_measure_naming_a_missing_table_or_column_is_refused():
    tables = {"t": _rows({0: [1.0]}, "passing", layer=1)}
    with pytest.raises(ValueError, match=r"Measure 'm': table 'u'.*\['t'\]"):
        compare_groups(tables, [Measure("m", "u", "v")])
    with pytest.raises(ValueError, match=r"columns \['site', 'w'\]"):
        compare_groups(tables, [Measure("m", "t", "w", (("layer", 1),), ("site",))])


def test_minus_subtracts_each_models_own_rows():
    # passing: ID - noise per model 0.3 and 0.5; failing 0.0 and 0.2 (model 4: no noise row)
    rows = [*_rows({0: [0.4], 1: [0.6]}, "passing", kind="id"),
            *_rows({0: [0.1], 1: [0.1]}, "passing", kind="noise"),
            *_rows({2: [0.1], 3: [0.5], 4: [0.9]}, "failing", kind="id"),
            *_rows({2: [0.1], 3: [0.3]}, "failing", kind="noise")]  # fmt: skip
    m = Measure("id - noise", "t", "v", (("kind", "id"),), minus=(("kind", "noise"),))
    rec = compare_groups({"t": rows}, [m])["all"]["id - noise"]
    assert (rec["n_passing"], rec["n_failing"]) == (2, 2)
    np.testing.assert_allclose([rec["passing"], rec["failing"], rec["difference"]], [0.4, 0.1, 0.3])

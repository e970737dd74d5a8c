"""Photographs resized as the reference's processors do (`data.inputs.resize`), against the
pixels transformers' default Qwen2-VL image processor (torchvision) and its PIL backend
stored (`tests/fixtures/resize/make_resize_fixtures.py`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxmech.data.inputs.resize import resize_bicubic
from jaxmech.families.qwen2_vl import processor

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "resize")
REF = np.load(os.path.join(HERE, "reference.npz"))
CASES = {"shrink": "jpg", "grow": "png", "mixed": "png"}


def settings(case: str, resize: str) -> processor.ImageSettings:
    lo, hi = (int(v) for v in REF[f"{case}/pixels"])
    return processor.ImageSettings(min_pixels=lo, max_pixels=hi, resize=resize)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_resize_equals_the_reference_processor(case, backend):
    """Level for level (so within 1/255 after normalisation, by far) equal to the
    reference processor's pixels, on a photograph it shrinks, grows, or both."""
    path = os.path.join(HERE, f"{case}.{CASES[case]}")
    levels, grid = processor.patches(path, settings(case, backend), codes=True)
    assert float(REF[f"{case}/{backend}_err"]) < 1e-6  # the levels hold the floats
    assert grid == tuple(REF[f"{case}/grid"][0])
    np.testing.assert_array_equal(levels, REF[f"{case}/{backend}"])


def test_the_two_backends_differ():
    """The setting matters: the PIL backend's pixels are not torchvision's (so the test
    above tells them apart), and the default is the reference's default."""
    assert processor.ImageSettings().resize == "torchvision"
    differ = [(REF[f"{c}/torchvision"] != REF[f"{c}/pil"]).mean() for c in CASES]
    assert max(differ) > 1e-3


def test_a_kept_size_is_untouched_and_a_bad_backend_is_named():
    x = np.random.default_rng(0).integers(0, 256, (28, 56, 3)).astype(np.uint8)
    np.testing.assert_array_equal(resize_bicubic(x, 28, 56), x)
    with pytest.raises(ValueError, match="resize = 'lanczos'"):
        resize_bicubic(x, 14, 28, "lanczos")

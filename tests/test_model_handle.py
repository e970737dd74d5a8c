"""The one model handle (`jaxmech.init`, `jaxmech.Model`) on the trained families: the
sites it lists are exactly the ones its forward names, a capture holds what it asks for,
and the handle's forward is the family's own. A loaded checkpoint's likewise: every
registered checkpoint family in tests/test_checkpoint_contract.py, a stand-in one in
tests/test_checkpoint_family.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmech
from jaxmech.config import Config
from jaxmech.data.tasks.scenes import SceneBatch
from jaxmech.families.dual_encoder import model as dual
from jaxmech.families.toy_vlm import model as toy
from jaxmech.model import check_capture
from jaxmech.train import build_data

DUAL = dict(d_embed=16, image_len=8, n_labels=8, n_val_labels=3, n_pair_labels=5,
            layouts_per_pair=5, d_model=32, d_head=8, n_heads=4, n_layers=2, mlp=True,
            d_mlp=32)  # fmt: skip
TOY = dict(task_kind="scenes", model_kind="toy_vlm", grid_h=2, grid_w=3, n_labels=6,
           n_val_labels=2, n_pair_labels=4, d_model=16, d_head=8, n_heads=2, d_mlp=16,
           n_layers=2, lm_n_layers=2)  # fmt: skip


def dual_case():
    config = Config().replace(**DUAL)
    data = build_data(config)
    images = jnp.asarray(data.evals.unseen_images[:3])
    captions = jnp.asarray(data.tables.captions[[0, 5, -1]])
    return "dual_encoder", config, (images, captions)


def toy_case():
    config = Config().replace(**TOY)
    rng = np.random.default_rng(0)
    cells = [jnp.asarray(rng.integers(1, n, (3, 6)), jnp.int32) for n in (7, 5, 3)]
    question = jnp.asarray(rng.integers(0, 15, (3, 8)), jnp.int32)
    return "toy_vlm", config, SceneBatch(*cells, question, question[:, 0], question[:, 0] * 0)


@pytest.mark.parametrize("case", [dual_case, toy_case], ids=["dual_encoder", "toy_vlm"])
def test_sites_are_the_forwards_names(case):
    kind, config, inputs = case()
    model = jaxmech.init(kind, config, jax.random.key(1))
    out, aux = model.forward(inputs, capture=True)
    assert set(aux) == set(model.sites()) and len(model.sites()) == len(set(model.sites()))
    # a named capture holds those sites whole; none holds nothing; the output is the same
    some = model.sites()[-3:]
    out_some, aux_some = model.forward(inputs, capture=some)
    assert set(aux_some) == set(some)
    for name in some:
        np.testing.assert_array_equal(aux_some[name], aux[name])
    plain, nothing = model.forward(inputs)
    assert nothing == {}
    np.testing.assert_allclose(plain, out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out_some, out, rtol=1e-6, atol=1e-6)


def test_handle_forward_is_the_familys():
    kind, config, (images, captions) = dual_case()
    model = jaxmech.init(kind, config, jax.random.key(1))
    direct, _ = dual.forward(model.params, images, captions)
    np.testing.assert_array_equal(model.forward((images, captions))[0], direct)
    kind, config, batch = toy_case()
    model = jaxmech.init(kind, config, jax.random.key(1))
    direct = toy.forward(model.params, *batch[:4])[0]
    np.testing.assert_array_equal(model.forward(batch)[0], direct)


def test_bad_uses_are_refused_by_name():
    kind, config, inputs = dual_case()
    model = jaxmech.init(kind, config, jax.random.key(1))
    with pytest.raises(ValueError, match="capture = 'vision/embed'"):
        model.forward(inputs, capture="vision/embed")
    # a name the forward never records is refused, not returned missing; a site's part
    # before its "." (every block's) is a name the recorders read
    with pytest.raises(ValueError, match="capture: 'vision/nowhere' is not a site"):
        model.forward(inputs, capture=[model.sites()[0], "vision/nowhere"])
    check_capture(["lm/resid_pre", "lm/resid_pre.1"], ["lm/resid_pre.0", "lm/resid_pre.1"])
    with pytest.raises(ValueError, match="'lm/resid_pre.2' is not a site"):
        check_capture(["lm/resid_pre.2"], ["lm/resid_pre.0", "lm/resid_pre.1"])
    with pytest.raises(ValueError, match="not a loaded checkpoint"):
        model.encode(["x.png"], ["Is it?"])
    with pytest.raises(ValueError, match="not a VLM family"):
        model.view()
    with pytest.raises(ValueError, match="qwen2_vl.*checkpoint family"):
        jaxmech.init("qwen2_vl", config, jax.random.key(1))

"""Config defaults (SPEC), validation and serialisation."""

import dataclasses
import math

import pytest

from jaxmech.config import (
    SWEEPABLE,
    Config,
    ConfigError,
    Settings,
    TaskConfig,
    TrainConfig,
    TransformerConfig,
)

SPEC_DEFAULTS = {
    # task
    "image_len": 10,
    "n_labels": 20,
    "n_val_labels": 5,
    "n_pair_labels": 15,
    "n_single_holdout": 2,
    "layouts_per_pair": 15,
    "single_captions": "side",
    "caption_mode": "left",
    "single_frac": 0.5,
    # model
    "n_layers": 1,
    "n_heads": 4,
    "d_model": 128,
    "d_head": 32,
    "d_embed": 128,
    "layernorm": False,
    "mlp": False,
    "causal_text": True,
    "cls_position": False,
    "init_E": 0.02,
    "init_P": 0.02,
    # train
    "batch_size": 256,
    "steps": 1500,
    "eval_every": 250,
    "lr": 1e-3,
    "warmup_steps": 100,
    "b1": 0.9,
    "b2": 0.98,
    "weight_decay": 0.1,
}


@pytest.mark.parametrize("field,value", sorted(SPEC_DEFAULTS.items()))
def test_default_matches_spec(field, value):
    assert Config().flat()[field] == value


def test_default_logit_scale_and_derived_values():
    c = Config()
    assert math.isclose(c.model.logit_scale_init, math.log(1 / 0.07))
    assert math.isclose(c.model.logit_scale_max, math.log(100.0))
    assert c.task.n_layouts == 45
    assert c.task.max_pair_labels == 15
    assert c.model.text_layers == c.model.n_layers == 1
    assert c.train.n_evals == 6
    assert Config().replace(image_len=6).task.n_layouts == 15
    assert Config().replace(n_layers=3).model.text_layers == 3
    assert Config().replace(n_layers=3, text_n_layers=1).model.text_layers == 1


def test_flat_field_names_are_unique_and_grouped():
    names = Config.field_names()
    assert len(names) == len(set(names))
    c = Config()
    own = [f.name for g in (c.task, c.model, c.train) for f in dataclasses.fields(g)]
    assert len(own) == len(set(own)) and set(c.flat()) == set(own)
    assert set(own) < set(names)  # the flags cover every family's and task's fields
    assert {"vit_pos", "grid_h", "n_colours", "vision_pos", "caption_mode"} <= set(names)


def test_the_model_and_task_groups_are_the_chosen_family_and_task_configs():
    from jaxmech.data.tasks.scenes import SceneConfig
    from jaxmech.families.dual_encoder.config import DualEncoderConfig
    from jaxmech.families.toy_vlm.config import ToyVLMConfig

    c = Config()
    assert type(c.model) is DualEncoderConfig and c.task.task_kind == "1d"
    v = c.replace(model_kind="toy_vlm", task_kind="scenes", grid_h=3, d_model=16, n_heads=2)
    assert type(v.model) is ToyVLMConfig and type(v.task) is SceneConfig
    assert v.task.image_len == 12 and v.model.d_model == 16  # derived (3 x 4); shared
    assert not hasattr(v.model, "vision_pos") and not hasattr(v.task, "caption_mode")
    # a field the chosen family or task does not have is refused, naming them
    with pytest.raises(ConfigError, match="vision_pos is not a field of model_kind = 'toy_vlm'"):
        v.replace(vision_pos="rope")
    with pytest.raises(ConfigError, match="grid_h is not a field of task_kind = '1d'"):
        c.replace(grid_h=3)
    with pytest.raises(ConfigError, match="model_kind = 'nope' is invalid"):
        c.replace(model_kind="nope")
    # the fields both configs share keep their values across a switch and back
    back = v.replace(model_kind="dual_encoder", task_kind="1d", image_len=10)
    assert back.model.d_model == 16 and back.model.vision_pos == "learned"
    assert Config.from_json(v.to_json()) == v
    # a folder written before the split lists every field: the unused defaults drop out
    import json

    raw = json.loads(v.to_json())
    raw["model"] |= {"vision_pos": "learned", "d_embed": 128}
    raw["task"] |= {"caption_mode": "left"}
    assert Config.from_json(json.dumps(raw)) == v
    raw["model"]["vision_pos"] = "rope"  # but one that was set is an error, by name
    with pytest.raises(ConfigError, match="vision_pos"):
        Config.from_json(json.dumps(raw))


BAD_VALUES = [
    # (overrides, field named in the message, bad value named in the message)
    ({"n_pair_labels": 16}, "n_pair_labels", 16),
    ({"n_val_labels": 10, "n_pair_labels": 11}, "n_pair_labels", 11),
    ({"n_pair_labels": 1}, "n_pair_labels", 1),
    ({"layouts_per_pair": 46}, "layouts_per_pair", 46),
    ({"layouts_per_pair": 0}, "layouts_per_pair", 0),
    ({"image_len": 5, "n_single_holdout": 1, "layouts_per_pair": 11}, "layouts_per_pair", 11),
    ({"image_len": 1}, "image_len", 1),
    ({"image_len": 0}, "image_len", 0),
    ({"d_model": 130}, "d_model", 130),
    ({"n_heads": 3}, "d_model", 128),
    ({"steps": 0}, "steps", 0),
    ({"steps": -5}, "steps", -5),
    ({"batch_size": 0}, "batch_size", 0),
    ({"batch_size": -1}, "batch_size", -1),
    ({"eval_every": 400}, "eval_every", 400),
    ({"steps": 100, "eval_every": 250}, "eval_every", 250),
    ({"single_captions": "sides"}, "single_captions", "sides"),
    ({"caption_mode": "right"}, "caption_mode", "right"),
    ({"single_frac": 1.5}, "single_frac", 1.5),
    ({"single_frac": -0.1}, "single_frac", -0.1),
    ({"lr": 0.0}, "lr", 0.0),
    ({"lr": -1e-3}, "lr", -0.001),
    ({"n_single_holdout": 10}, "n_single_holdout", 10),
    ({"layernorm": 1}, "layernorm", 1),
    ({"init_E": 0.0}, "init_E", 0.0),
    ({"weight_decay": -0.1}, "weight_decay", -0.1),
    ({"n_layers": 0}, "n_layers", 0),
    ({"n_layers": 1.0}, "n_layers", 1.0),
]


@pytest.mark.parametrize(
    "overrides,field,value", BAD_VALUES, ids=[f"{f}={v!r}" for _, f, v in BAD_VALUES]
)
def test_bad_value_raises_naming_field_and_value(overrides, field, value):
    with pytest.raises(ConfigError) as err:
        Config().replace(**overrides)
    msg = str(err.value)
    assert f"{field} = {value!r}" in msg


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_bad_group_values_raise_directly():
    with pytest.raises(ConfigError, match="layouts_per_pair"):
        TaskConfig(layouts_per_pair=100)
    with pytest.raises(ConfigError, match="d_model"):
        TransformerConfig(d_model=10, n_heads=4)
    with pytest.raises(ConfigError, match="eval_every"):
        TrainConfig(steps=10, eval_every=3)


def test_unknown_field_raises():
    with pytest.raises(ConfigError, match="'foo'"):
        Config().replace(foo=1)
    with pytest.raises(ConfigError, match="'foo'"):
        Config.from_flat({"lr": 1e-3, "foo": 1})


@pytest.mark.parametrize(
    "overrides",
    [
        {"n_pair_labels": 15, "layouts_per_pair": 45, "single_frac": 1.0},
        {"n_pair_labels": 2, "layouts_per_pair": 1, "single_frac": 0.0},
        {"image_len": 2, "n_single_holdout": 1, "layouts_per_pair": 1},
        {"steps": 7, "eval_every": 7},
        {"n_val_labels": 10, "n_pair_labels": 10},
    ],
)
def test_boundary_values_are_accepted(overrides):
    c = Config().replace(**overrides)
    for k, v in overrides.items():
        assert c.flat()[k] == v


def test_replace_is_validated_and_does_not_mutate():
    base = Config()
    new = base.replace(n_pair_labels=5, lr=3e-4, n_layers=2)
    assert base.task.n_pair_labels == 15 and base.train.lr == 1e-3
    assert new.task.n_pair_labels == 5 and new.train.lr == 3e-4 and new.model.n_layers == 2
    # untouched groups are kept
    assert new.task.layouts_per_pair == 15 and new.model.d_model == 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.task.n_pair_labels = 3  # type: ignore[misc]


def test_json_round_trip():
    c = Config().replace(
        n_pair_labels=7,
        layouts_per_pair=3,
        single_captions="side_pair",
        caption_mode="left_right",
        single_frac=0.25,
        n_layers=2,
        text_n_layers=1,
        layernorm=True,
        init_E=0.1,
        lr=3e-4,
        steps=500,
        eval_every=100,
        seed=4,
    )
    text = c.to_json()
    back = Config.from_json(text)
    assert back == c
    assert back.to_json() == text
    assert Config.from_json(Config().to_json()) == Config()
    assert back != Config()


def test_from_json_partial_uses_defaults_and_validates():
    assert Config.from_json('{"task": {"n_pair_labels": 5}}') == Config().replace(n_pair_labels=5)
    with pytest.raises(ConfigError, match="n_pair_labels"):
        Config.from_json('{"task": {"n_pair_labels": 50}}')


def test_settings():
    s = Config().replace(n_pair_labels=5).settings()
    assert isinstance(s, Settings)
    assert s.n_pair_labels == 5
    assert s._fields == SWEEPABLE
    d = Config().replace(layouts_per_pair=3, single_frac=0.2, lr=2e-3, weight_decay=0.0, seed=9)
    s = d.settings()
    assert (s.seed, s.layouts_per_pair, s.single_frac, s.lr, s.weight_decay) == (
        9,
        3,
        0.2,
        2e-3,
        0.0,
    )
    assert Config().settings().n_pair_labels == 15

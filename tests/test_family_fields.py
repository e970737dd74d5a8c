"""The checkpoint families' shared config fields (`families.fields`): one tiny default
set valid in every family, and the same refusal, naming the field, in every family."""

import dataclasses
import importlib

import pytest

from jaxmech.config import ConfigError
from jaxmech.families import fields

CONFIGS = {"llava": "LlavaConfig", "gemma3": "Gemma3Config", "internvl": "InternVLConfig",
           "mllama": "MllamaConfig", "qwen2_vl": "QwenVLConfig"}  # fmt: skip
SHARED = dataclasses.fields(fields.VisionFields) + dataclasses.fields(fields.TextFields)
BAD = [(name, 0) for name in fields.VISION_SIZES + fields.TEXT_SIZES] + [
    ("vit_eps", 0.0),
    ("lm_eps", -1e-6),
    ("vit_act", "relu6"),
]


def config_class(family: str) -> type:
    return getattr(importlib.import_module(f"jaxmech.families.{family}.config"), CONFIGS[family])


@pytest.mark.parametrize("family", CONFIGS)
def test_the_shared_defaults_make_a_valid_config_in_every_family(family):
    c = config_class(family)()
    assert isinstance(c, fields.VisionFields) and isinstance(c, fields.TextFields)
    # no family declares a shared field again with its own default
    assert {f.name: getattr(c, f.name) for f in SHARED} == {f.name: f.default for f in SHARED}


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("name, bad", BAD)
def test_every_family_refuses_a_bad_shared_field_by_name(family, name, bad):
    c = config_class(family)()
    with pytest.raises(ConfigError, match=f"^{name} = {bad!r} is invalid"):
        dataclasses.replace(c, **{name: bad})


@pytest.mark.parametrize("family", CONFIGS)
def test_the_image_token_is_a_row_of_the_embedding(family):
    c = config_class(family)()
    last = c.embed_rows - 1
    assert dataclasses.replace(c, image_token_id=last).image_token_id == last
    with pytest.raises(ConfigError, match=f"^image_token_id = {c.embed_rows} is invalid"):
        dataclasses.replace(c, image_token_id=c.embed_rows)


def test_model_type_names_what_it_refuses_and_what_is_allowed():
    assert fields.model_type({"model_type": "llava"}, ("llava",)) == "llava"
    refused = r"model_type = 'gemma3' is not supported: allowed 'llava'$"
    with pytest.raises(ConfigError, match=refused):
        fields.model_type({"model_type": "gemma3"}, ("llava",))
    with pytest.raises(ConfigError, match=r"model_type = None .* allowed one of 'a', 'b'$"):
        fields.model_type({}, ("a", "b"))

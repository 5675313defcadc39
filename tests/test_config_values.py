"""config.json values of the wrong type or non-finite: refused at load as one ConfigError naming the field and
what is expected (they raised AttributeError, failed inside transformers, or trained with NaN loss)."""

import json
import math

import pytest

from m3jax.config import ConfigError, M3Config
from tests.test_config import field_value, released_dict, tiny_native


@pytest.mark.parametrize("field", ["rms_norm_eps", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_floats_are_refused(field, value):
    d = tiny_native()
    d[field] = value
    with pytest.raises(ConfigError, match=field_value(field, value) + ".*positive finite number"):
        M3Config.from_hf_dict(d)


def test_a_nan_rope_theta_is_refused():
    d = tiny_native()
    d["rope_parameters"]["rope_theta"] = math.nan
    with pytest.raises(ConfigError, match=field_value("rope_theta", math.nan)):
        M3Config.from_hf_dict(d)


@pytest.mark.parametrize("field, value", [("bos_token_id", "x"), ("pad_token_id", 1.5), ("eos_token_id", "x"),
                                          ("eos_token_id", [1, "x"]), ("bos_token_id", -1), ("pad_token_id", True)])
def test_token_ids_must_be_ids(field, value):
    d = tiny_native()
    d[field] = value
    shown = "x" if value == [1, "x"] else value
    with pytest.raises(ConfigError, match=field_value(field, shown) + ".*token id"):
        M3Config.from_hf_dict(d)


def test_token_ids_may_be_null_or_a_list():
    d = tiny_native()
    d.update(bos_token_id=None, pad_token_id=None, eos_token_id=[1, 2])
    assert M3Config.from_hf_dict(d).eos_token_id == (1, 2)


@pytest.mark.parametrize("value", ["oops", 3, ["default"]])
def test_rope_parameters_not_an_object(value, tmp_path):
    d = tiny_native()
    d["rope_parameters"] = value
    with pytest.raises(ConfigError, match=field_value("rope_parameters", value) + ".*an object"):
        M3Config.from_hf_dict(d)
    (tmp_path / "config.json").write_text(json.dumps(d))  # what convert, eval --hf and plan read
    with pytest.raises(ConfigError, match="rope_parameters"):
        M3Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("field", ["layer_types", "mlp_layer_types"])
def test_a_layer_list_given_as_a_string_is_shown_as_given(field):
    d = tiny_native()
    d[field] = d[field][0]
    with pytest.raises(ConfigError, match=field_value(field, d[field]) + ".*a list with one entry per layer"):
        M3Config.from_hf_dict(d)


@pytest.mark.parametrize("released", [False, True])
def test_tie_word_embeddings_is_reported_as_written(released):
    d = released_dict(tie_word_embeddings="yes") if released else dict(tiny_native(), tie_word_embeddings="yes")
    with pytest.raises(ConfigError, match=field_value("tie_word_embeddings", "yes")):
        M3Config.from_hf_dict(d)

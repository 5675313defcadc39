"""A model without MoE layers, or without sparse (indexer) layers, trains like any other; the replays of what it has
no layer for are refused at load (rl.config.model_checks)."""

import math

import pytest

from rl.config import ConfigError, load_config
from tests.tiny_runs import TINY, first_step

DENSE_ONLY = "model.tiny.mlp_layer_types=[dense, dense]"
FULL_ONLY = "model.tiny.layer_types=[full_attention, full_attention]"


def test_a_model_without_moe_layers_trains(tmp_path):
    # the generator's routes of zero MoE layers stopped the first step in rl.phases.route_metrics (a reshape)
    metrics = first_step(tmp_path, "dense", "eval.at_start=false", DENSE_ONLY)
    assert math.isfinite(metrics["loss"]) and "moe/route_mismatch_frac" not in metrics
    assert "indexer/selection_mismatch_frac" in metrics  # its sparse layer is compared as before


@pytest.mark.parametrize("overrides, key, message", [
    ((DENSE_ONLY, "grpo.routing_replay=rollout"), "grpo.routing_replay",
     r"no MoE layer whose routes could be replayed \(model.tiny.mlp_layer_types holds no \"sparse\"\)"),
    ((FULL_ONLY, "grpo.indexer_replay=rollout"), "grpo.indexer_replay",
     r"no sparse \(indexer\) layer whose block selection could be replayed"),
])
def test_a_replay_of_layers_the_model_lacks_is_refused(overrides, key, message):
    with pytest.raises(ConfigError, match=key + r" = \"rollout\": the model has " + message):
        load_config(str(TINY), list(overrides), check_paths=False)
    assert load_config(str(TINY), [overrides[0]], check_paths=False)

"""model.tiny: {preset: release} (m3jax.presets): a randomly initialised model with the released model's shapes, and
configs/recipes/m3-32node-random.yaml, the 32-node recipe on it. Before, a run at the release's shapes without its
checkpoint had to copy some twenty fields into model.tiny by hand."""

import dataclasses
from pathlib import Path

import pytest

from m3jax.config import M3Config
from m3jax.plan.flops import Hardware
from m3jax.plan.job import load_job, plan
from m3jax.plan.models import m3_release
from m3jax.presets import release_fields
from rl.config import ConfigError, load_config, to_yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RANDOM = CONFIGS / "recipes" / "m3-32node-random.yaml"
RECIPE = CONFIGS / "recipes" / "m3-32node.yaml"
TINY = CONFIGS / "tiny.yaml"


def test_the_random_recipe_is_the_recipe_on_the_release_shapes_with_no_path_to_give(tmp_path):
    cfg = load_config(RANDOM)  # checks its paths: there are none
    assert M3Config(**cfg.model.tiny) == m3_release() and cfg.model.path is None
    recipe = load_config(RECIPE, ["model.path=/m", "data.path=/d", "eval.path=/e"], check_paths=False)
    for section in ("mesh", "precision", "optim", "grpo", "generation"):
        assert getattr(cfg, section) == getattr(recipe, section), section
    assert dataclasses.replace(cfg.model, path="/m", tiny=None) == recipe.model  # every model option
    assert dataclasses.replace(cfg.checkpoint, export_hf_at_end=True) == recipe.checkpoint
    assert (cfg.data.kind, cfg.eval.enabled, cfg.run.total_steps) == ("synthetic", False, 10)
    # the planner plans it as the release: what its run is for
    random, release = (plan(load_job(str(RANDOM), [], None), Hardware()),
                       plan(load_job(str(RECIPE), [], "release"), Hardware()))
    assert random == release
    # --print-config writes the preset out in full, and that loads back the same
    printed = tmp_path / "printed.yaml"
    printed.write_text(to_yaml(cfg))
    assert "preset" not in printed.read_text() and load_config(printed) == cfg


@pytest.mark.parametrize("depth, full", [(1, 1), (3, 3), (5, 3)])
def test_a_preset_at_another_depth_keeps_the_release_layer_pattern(depth, full):
    tiny = load_config(RANDOM, [f"model.tiny.num_hidden_layers={depth}"]).model.tiny
    assert M3Config(**tiny) == m3_release(full, depth - full)
    # a field beside the preset replaces its own; given whole, the layer lists are the user's
    tiny = load_config(RANDOM, ["model.tiny={preset: release, hidden_size: 1024, num_hidden_layers: 2, "
                                "layer_types: [minimax_m3_sparse, full_attention], mlp_layer_types: [sparse, dense]}"]
                       ).model.tiny
    assert (tiny["hidden_size"], tiny["layer_types"], tiny["vocab_size"]) == (
        1024, ["minimax_m3_sparse", "full_attention"], 200064)
    # one list given: the other is the preset's at that depth (it was the release's 60 entries, an error blamed on
    # a default)
    tiny = load_config(RANDOM, ["model.tiny={preset: release, num_hidden_layers: 2, "
                                "layer_types: [minimax_m3_sparse, full_attention]}"]).model.tiny
    assert (tiny["layer_types"], tiny["mlp_layer_types"]) == (["minimax_m3_sparse", "full_attention"], ["dense"] * 2)


@pytest.mark.parametrize("override", ["model.tiny.preset=release", "model.tiny={preset: release}"])
def test_a_preset_replaces_an_inherited_tiny_model_instead_of_merging_into_it(override):
    """tiny.yaml's own fields would otherwise replace every field of the preset: a tiny model, silently."""
    cfg = load_config(TINY, [override, "model.tiny.num_local_experts=16"], check_paths=False)
    assert cfg.model.tiny == {**release_fields(), "num_local_experts": 16}


def test_a_preset_replaces_what_model_tiny_held_before_it_so_fields_go_after_it():
    assert load_config(RANDOM, ["model.tiny.hidden_size=1024", "model.tiny.preset=release"]).model.tiny[
        "hidden_size"] == 6144  # documented: the preset starts the model over
    assert load_config(RANDOM, ["model.tiny.preset=release", "model.tiny.hidden_size=1024"]).model.tiny[
        "hidden_size"] == 1024


@pytest.mark.parametrize("override, key, allowed", [
    ("model.tiny={preset: relase}", "model.tiny.preset = 'relase': no such model preset", "allowed: release"),
    ("model.tiny.preset=release2", "model.tiny.preset = 'release2': no such model preset", "allowed: release"),
    # not a name at all: a TypeError (unhashable) escaped the loader as a traceback
    ("model.tiny.preset=[release]", "model.tiny.preset = ['release']: no such model preset", "allowed: release"),
    ("model.tiny={presett: release}", "model.tiny.presett: unknown key (did you mean 'preset'?)", "preset"),
    # a field the preset filled in is named as the preset's, not as a default
    ("model.tiny={preset: release, num_local_experts: 2}", "model.tiny.num_experts_per_tok = 4",
     "[set by the model preset named by override 'model.tiny={preset: release, num_local_experts: 2}']"),
    ("model.tiny={preset: release, num_hidden_layers: 0}", "model.tiny.num_hidden_layers = 0 with preset 'release'",
     "allowed: an integer >= 1"),
])
def test_a_bad_preset_is_one_error_naming_what_is_allowed(override, key, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(RANDOM, [override])
    problems = str(e.value).splitlines()
    assert len(problems) == 1 and key in problems[0] and allowed in problems[0] and override in problems[0], problems

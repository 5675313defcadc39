"""rl.start_warnings: settings a run's length or model makes moot are warned of as it starts (a helper's audit found
each passing silently)."""

from rl.config import load_config
from rl.start_warnings import start_warnings
from tests.tiny_runs import TINY


def _warnings(*overrides):
    cfg = load_config(str(TINY), list(overrides), check_paths=False)
    return start_warnings(cfg, cfg.model.m3_config())


def test_the_tiny_config_is_warned_of_nothing():
    assert _warnings() == []
    assert _warnings("optim.warmup_steps=199", "grpo.kl=k3", "grpo.kl_coef=0.01",
                     "grpo.reference_reset_every_steps=199", "model.remat=true", "model.remat_policy=save_dots") == []


def test_a_warm_up_or_a_reset_period_as_long_as_the_run():
    """optim.warmup_steps 1000 in a 200-step run trained at most at a fifth of optim.lr; a reset period past the
    run's end never reset. A short trial of a long recipe is meant to stop early: warnings, not refusals."""
    assert _warnings("optim.warmup_steps=1000", "grpo.kl=k3", "grpo.kl_coef=0.01",
                     "grpo.reference_reset_every_steps=200") == [
        "optim.warmup_steps = 1000 is not below run.total_steps = 200: the learning rate never reaches optim.lr = "
        "0.001 (its last step trains at 0.000199)",
        "grpo.reference_reset_every_steps = 200 is not below run.total_steps = 200: the KL reference is not reset "
        "while the run trains"]


def test_options_for_what_is_switched_off_or_absent():
    assert _warnings("model.remat_policy=save_dots_experts") == [
        "model.remat_policy = save_dots_experts has no effect with model.remat = false (every activation is kept for "
        "the backward)"]
    assert _warnings("logging.indexer_recall_every=5", "model.tiny.layer_types=[full_attention, full_attention]",
                     "model.tiny.mlp_layer_types=[dense, dense]", "model.moe_capacity_factor=1.5") == [
        "logging.indexer_recall_every = 5: the model has no sparse (indexer) layer, so no indexer/recall is logged",
        "model.moe_capacity_factor = 1.5 has no effect: the model has no MoE layer"]
    assert _warnings("logging.indexer_recall_every=5", "model.moe_capacity_factor=1.5") == []
    assert _warnings("logging.moe_drops_every=5") == [
        "logging.moe_drops_every = 5: model.moe_capacity_factor is null (dropless), so moe/dropped_frac is always 0"]
    assert _warnings("logging.moe_drops_every=5", "model.tiny.mlp_layer_types=[dense, dense]") == [
        "logging.moe_drops_every = 5: the model has no MoE layer, so no moe/dropped_frac is logged"]
    assert _warnings("logging.moe_drops_every=5", "model.moe_capacity_factor=1.5") == []


def test_the_shipped_configs_warn_of_nothing_but_the_short_trials_warm_up():
    """A config of ours that warns as it starts teaches users to skip warnings. The random recipe's 10 steps and the
    miniature's 4 end inside their recipe's 10-step warm-up, which both keep as the recipe's (tests/test_run_config
    holds the miniature's optim to the recipe's): said, as it is true; so are the recipe's vLLM settings that the
    miniature, on the JAX engine, does not use."""
    import glob
    for path in sorted(glob.glob("configs/*.yaml") + glob.glob("configs/recipes/*.yaml")):
        if path.endswith(("base.yaml", "m3-32node.yaml")):  # no model to read without their paths
            continue
        cfg = load_config(path, [], check_paths=False)
        got = start_warnings(cfg, cfg.model.m3_config())
        want = ["optim.warmup_steps = 10"] if path.endswith(("m3-32node-random.yaml", "m3-32node-miniature.yaml")) \
            else []
        if path.endswith("m3-32node-miniature.yaml"):  # the recipe's vLLM pool settings, on the JAX engine
            want.append("generation.vllm_tensor_parallel = 16")
        assert len(got) == len(want) and all(w.startswith(start) for w, start in zip(got, want)), (path, got)


def test_trajectories_drawn_ahead_that_cannot_be_or_go_uncorrected():
    """A helper's audit: age 1 with a checkpoint after every step drew nothing ahead (the pipeline drains before
    each save), silently; and stale samples without an importance correction trained as on-policy ones."""
    assert _warnings("grpo.max_trajectory_age_steps=1", "checkpoint.every_steps=2") == []
    assert _warnings("grpo.max_trajectory_age_steps=1", "checkpoint.every_steps=1") == [
        "grpo.max_trajectory_age_steps = 1 has no effect: a checkpoint (checkpoint.every_steps = 1) or an evaluation "
        "(eval.every_steps = 20) follows every step, and the pipeline drains before each, so no step is drawn ahead "
        "(the run is on-policy)"]
    assert len(_warnings("grpo.max_trajectory_age_steps=1", "checkpoint.every_steps=2", "eval.every_steps=3")) == 0
    assert len(_warnings("grpo.max_trajectory_age_steps=1", "checkpoint.every_steps=2", "eval.every_steps=1")) == 1
    assert _warnings("grpo.max_trajectory_age_steps=1", "grpo.is_correction=none") == [
        "grpo.max_trajectory_age_steps = 1 with grpo.is_correction = none: the steps drawn ahead, by the weights "
        "before the last update, are trained on as if the policy being trained had drawn them"]



def test_reference_reset_options_without_resets():
    """A helper's audit: TRL's sync_ref_model row without its period mixed nothing, silently."""
    assert _warnings("grpo.kl=k3", "grpo.kl_coef=0.04", "grpo.reference_reset_mix=0.6",
                     "grpo.reference_reset_optimizer=false") == [
        "grpo.reference_reset_mix = 0.6 and grpo.reference_reset_optimizer = false have no effect: "
        "grpo.reference_reset_every_steps = 0 never resets the KL reference"]
    assert _warnings("grpo.kl=k3", "grpo.kl_coef=0.04", "grpo.reference_reset_mix=0.6",
                     "grpo.reference_reset_every_steps=50") == []


def test_vllm_settings_on_the_jax_engine():
    """A user who set the vLLM pool's size or transport and left generation.backend at jax got the in-process engine
    without a word (the settings were read by nothing)."""
    assert _warnings("generation.vllm_servers=4", "generation.weight_transport=shm") == [
        "generation.vllm_servers = 4, generation.weight_transport = shm have no effect: generation.backend = jax "
        "generates in this process with the trainer's parameters (no vLLM engine, no weight transfer)"]
    assert _warnings("generation.vllm_gpu_memory_utilization=0.8", "generation.verify_probes=0") == []  # defaults
    assert _warnings("generation.backend=vllm", "generation.vllm_servers=4", "generation.verify_probes=2") == []

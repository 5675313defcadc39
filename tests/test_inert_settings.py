"""A setting changed from its default that another setting makes inert is named as the run starts
(rl.inert_settings, through rl.start_warnings): an audit's run with twenty such settings trained bit for bit as one
without them, and said nothing."""

import glob

import pytest

from rl.config import load_config
from rl.inert_settings import fields_named, inert_settings
from rl.start_warnings import start_warnings
from tests.test_run_config import TINY


def warned(*overrides) -> list[str]:
    cfg = load_config(TINY, list(overrides))
    return start_warnings(cfg, cfg.model.m3_config())


@pytest.mark.parametrize("overrides, line", [
    (["grpo.overlong_penalty=5"], "grpo.overlong_penalty = 5 has no effect: grpo.overlong_buffer = 0 turns the soft "
                                  "overlong punishment off"),
    (["grpo.loss=gspo", "grpo.eps_low=0.3", "grpo.eps_high=0.9"],
     "grpo.eps_low = 0.3, grpo.eps_high = 0.9 have no effect: grpo.loss = gspo (only ppo_clip and clip_cov clip the "
     "ratio by eps_low / eps_high)"),
    (["grpo.sapo_tau_neg=3"], "grpo.sapo_tau_neg = 3 has no effect: grpo.loss = ppo_clip (only sapo reads them)"),
    (["grpo.cispo_eps_high=5"], "grpo.cispo_eps_high = 5 has no effect: grpo.loss = ppo_clip (only cispo"),
    (["grpo.kl_cov_coef=3"], "grpo.kl_cov_coef = 3 has no effect: grpo.loss = ppo_clip (only kl_cov reads them)"),
    (["grpo.clip_cov_ratio=0.5"], "grpo.clip_cov_ratio = 0.5 has no effect: grpo.loss = ppo_clip (only clip_cov"),
    (["grpo.gmpo_eps_low=0.01"], "grpo.gmpo_eps_low = 0.01 has no effect: grpo.loss = ppo_clip (only gmpo"),
    (["grpo.gspo_eps_high=0.01"], "grpo.gspo_eps_high = 0.01 has no effect: grpo.loss = ppo_clip (only gspo"),
    (["grpo.is_correction=none", "grpo.is_cap=1.01", "grpo.is_level=sequence"],
     "grpo.is_cap = 1.01 has no effect: grpo.is_correction = none weighs every token 1"),
    (["grpo.is_correction=mask", "grpo.is_cap=3"], "grpo.is_cap = 3 has no effect: grpo.is_correction = mask"),
    (["grpo.kl_clamp=0.5"], "grpo.kl_clamp = 0.5 has no effect: there is no KL term (grpo.kl = none)"),
    (["grpo.dynamic_sampling_max_rounds=50"], "grpo.dynamic_sampling_max_rounds = 50 has no effect: "
                                               "grpo.dynamic_sampling = false draws one batch a step"),
    (["data.task=addmod", "data.num_digits=7"], "data.num_digits = 7 has no effect: the addmod task's prompts always "
                                                "have two digits"),
    (["logging.rollouts_groups=8"], "logging.rollouts_groups = 8 has no effect: logging.rollouts_every = 0"),
    (["logging.wandb_mode=offline"], "logging.wandb_mode = offline has no effect: logging.wandb_project = null"),
    (["generation.backend=vllm", "generation.weight_group_device=cpu"],
     "generation.weight_group_device = cpu has no effect: generation.weight_transport = ray opens no collective"),
    (["generation.backend=vllm", "generation.vllm_ray_address=auto", "generation.vllm_object_store_warmup=false"],
     "generation.vllm_object_store_warmup = False has no effect: the pool joins the Ray cluster"),
    (["generation.backend=vllm", "generation.weight_transport=collective", "generation.vllm_object_store_warmup=false"],
     "generation.vllm_object_store_warmup = False has no effect: generation.weight_transport = collective puts no"),
    (["mesh.context_balance=false"], "mesh.context_balance = False has no effect: mesh.context = 1 has no context"),
])
def test_an_inert_setting_is_named_with_why(overrides, line):
    lines = warned(*overrides)
    assert any(line in w for w in lines), lines


@pytest.mark.parametrize("overrides, named", [
    (["grpo.overlong_buffer=2", "grpo.overlong_penalty=5"], "overlong_penalty"),
    (["grpo.loss=clip_cov", "grpo.eps_high=0.9", "grpo.clip_cov_ratio=0.5"], "grpo."),
    (["grpo.loss=sapo", "grpo.sapo_tau_neg=3"], "sapo_tau"),  # tiny.yaml's eps_high 0.2 is named: sapo has no clip
    (["grpo.is_correction=mask", "grpo.is_level=sequence"], "is_level"),
    (["grpo.kl=k3", "grpo.kl_coef=0.01", "grpo.kl_clamp=0.5"], "kl_clamp"),
    (["grpo.dynamic_sampling=true", "grpo.dynamic_sampling_max_rounds=50"], "max_rounds"),
    (["logging.rollouts_every=5", "logging.rollouts_groups=8"], "rollouts_groups"),
    # the held-out task is copy: data.num_digits sizes its prompts (a review found this one named)
    (["data.task=addmod", "data.num_digits=6", "eval.task=copy", "reward=[{name: exact_digits}]",
      "eval.reward=[{name: copy_digits}]", "generation.max_prompt_tokens=16", "generation.max_new_tokens=8"],
     "num_digits"),
    (["generation.backend=vllm", "generation.weight_transport=collective", "generation.weight_group_device=cpu"],
     "weight_group_device"),
    (["generation.backend=vllm", "generation.weight_transport=shm", "generation.vllm_ray_address=auto",
      "generation.vllm_object_store_warmup=false"], "object_store"),
])
def test_a_setting_its_config_reads_is_not_named(overrides, named):
    lines = warned(*overrides)
    assert not any(named in w for w in lines), lines


def test_a_file_run_names_the_synthetic_task_and_a_loaded_model_its_seed(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1", "answer": "1"}\n')
    cfg = load_config(TINY, ["data.kind=file", f"data.path={tmp_path / 'p.jsonl'}", "data.task=addmod",
                             "model.tiny=null", f"model.path={tmp_path}", "model.init_seed=7", "eval.every_steps=0",
                             "eval.at_start=false"], check_paths=False)
    lines = inert_settings(cfg)
    assert "data.task = addmod has no effect: data.kind = file reads its prompts from data.path" in lines, lines
    assert "model.init_seed = 7 has no effect: model.path's weights are loaded, not drawn" in lines, lines


def test_every_named_field_is_a_setting_and_the_shipped_configs_name_none():
    cfg = load_config(TINY)
    for name in fields_named():
        section, field = name.split(".")
        assert hasattr(getattr(cfg, section), field), name
    for path in glob.glob("configs/*.yaml") + glob.glob("configs/recipes/*.yaml"):
        if path.endswith("base.yaml"):
            continue
        try:
            recipe = load_config(path, check_paths=False)
        except Exception:  # noqa: BLE001 - the real-data recipes need their three paths
            recipe = load_config(path, ["model.path=/m", "data.path=/d", "eval.path=/e"], check_paths=False)
        assert inert_settings(recipe) == [], path


def test_kl_cov_on_policy_with_a_separate_pass_is_warned_of():
    """On policy its penalty's gradient sign(logp - logp_old) is +-coef on round-off when logp_old comes from another
    program's forward: the tiny demo ended at reward 0.89 against 0.994 with old_logprobs: update (session 60)."""
    line = "grpo.loss = kl_cov with grpo.old_logprobs = pass: logp_old comes from a forward of its own"
    assert any(line in w for w in warned("grpo.loss=kl_cov", "grpo.dual_clip=null"))
    assert not any(line in w for w in warned("grpo.loss=kl_cov", "grpo.dual_clip=null", "grpo.old_logprobs=update"))
    assert not any(line in w for w in warned("grpo.loss=reinforce", "grpo.dual_clip=null"))

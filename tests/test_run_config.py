"""rl.config: shipped configs, base chains and deep merge, overrides, the --print-config round trip and the
dataclasses. One test per class of bad config file or override: tests/test_run_config_errors.py.
"""

import dataclasses
import datetime as dt
import textwrap
from pathlib import Path

import pytest

from rl import config as rc
from rl.config import ConfigError, RunConfig, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
TINY = CONFIGS / "tiny.yaml"
ONE_NODE = CONFIGS / "recipes" / "m3-1node-h200.yaml"
ONE_NODE_128E = CONFIGS / "recipes" / "m3-1node-h200-128e.yaml"
RECIPE = CONFIGS / "recipes" / "m3-32node.yaml"


def write(dirpath: Path, name: str, text: str) -> Path:
    p = dirpath / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


@pytest.fixture
def recipe_paths(tmp_path):
    """Stand-ins for the recipe's three user-supplied paths (the eval file holds two AIME-style problems)."""
    model = tmp_path / "MiniMax-M3"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "dapo.parquet"
    data.write_bytes(b"")
    aime = tmp_path / "aime-2024.jsonl"
    aime.write_text('{"problem": "Find x if 2x = 10.", "answer": "5"}\n'
                    '{"problem": "What is 3^2?", "answer": "9"}\n')
    return [f"model.path={model}", f"data.path={data}", f"eval.path={aime}"]


def delta(tmp_path: Path, body: str, name: str = "run.yaml") -> Path:
    """A config that inherits tiny.yaml and changes `body`."""
    return write(tmp_path, name, f"base: {TINY}\n" + textwrap.dedent(body))


def load_error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return str(e.value)


# ============================================================================== shipped configs
def test_every_shipped_config_loads(recipe_paths):
    tiny = load_config(TINY)
    one = load_config(ONE_NODE)
    recipe = load_config(RECIPE, recipe_paths)
    tiny_vllm = load_config(CONFIGS / "tiny-vllm.yaml")
    one_128e = load_config(ONE_NODE_128E)
    for cfg in (tiny, one, recipe, tiny_vllm, one_128e):
        assert isinstance(cfg, RunConfig)
    assert tiny_vllm.generation.backend == "vllm" and tiny_vllm.generation.vllm_servers == 2
    assert set(tiny_vllm.model.tiny["layer_types"]) == {"full_attention"}  # vLLM's CPU path has no sparse layers
    # the miniature (tests/test_recipe_miniature.py runs it) keeps every choice of the recipe that is not about
    # size, data or the GPU engine
    mini = load_config(CONFIGS / "recipes/m3-32node-miniature.yaml")
    assert mini.precision == recipe.precision and mini.optim == recipe.optim
    assert (mini.checkpoint.async_save, mini.checkpoint.export_layout) == (True, recipe.checkpoint.export_layout)
    assert mini.mesh.expert_axes == recipe.mesh.expert_axes == ("data", "context") and mini.mesh.context > 1
    for f in ("remat", "remat_policy", "attention_impl", "moe_kernel", "sparse_attention", "moe_capacity_factor"):
        assert getattr(mini.model, f) == getattr(recipe.model, f), f
    sized = {"prompts_per_step", "group_size", "micro_batch_widths"}
    assert {f.name: getattr(mini.grpo, f.name) for f in dataclasses.fields(mini.grpo) if f.name not in sized} == \
        {f.name: getattr(recipe.grpo, f.name) for f in dataclasses.fields(recipe.grpo) if f.name not in sized}
    shipped = {p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*.yaml")}
    assert shipped == {"base.yaml", "tiny.yaml", "tiny-vllm.yaml", "recipes/m3-1node-h200.yaml",
                       "recipes/m3-1node-h200-128e.yaml", "recipes/m3-32node.yaml",
                       "recipes/m3-32node-miniature.yaml", "recipes/m3-32node-random.yaml"}, \
        "a new shipped config needs a load test"
    # base.yaml is a template: it asks for a model and a reward, and nothing else
    msg = load_error(CONFIGS / "base.yaml")
    assert "reward = []" in msg and "non-empty list" in msg
    cfg = load_config(CONFIGS / "base.yaml", [f"model.path={recipe_paths[0].split('=')[1]}",
                                              "reward=[{name: reverse_digits}]"])
    assert cfg.reward[0] == rc.RewardSpec("reverse_digits", 1.0, 10.0)


def test_base_yaml_restates_the_dataclass_defaults():
    raw = rc.load_yaml((CONFIGS / "base.yaml").read_text())
    assert "base" not in raw
    raw["run"]["out_dir"] = raw["run"]["out_dir"].replace("${name}", raw["run"]["name"])
    assert raw == rc.defaults_dict()


def test_tiny_is_the_calibrated_cpu_demo():
    cfg = load_config(TINY)
    m3 = cfg.model.m3_config()
    assert m3.vocab_size == 16 and m3.has_moe and m3.has_sparse_attention
    assert set(m3.layer_types) == {"full_attention", "minimax_m3_sparse"}
    assert set(m3.mlp_layer_types) == {"dense", "sparse"}
    g = cfg.grpo
    assert (g.prompts_per_step, g.group_size, g.updates_per_step, g.kl) == (32, 8, 1, "none")
    assert (cfg.optim.lr, cfg.optim.clip_norm, cfg.precision.master) == (1e-3, 1.0, "none")
    assert cfg.precision.param_dtype == "float32"
    assert cfg.mesh.num_devices == 1
    assert (cfg.data.task, cfg.data.num_digits, cfg.run.total_steps, cfg.checkpoint.every_steps) == \
        ("copy", 4, 200, 20)
    assert 5 <= cfg.generation.max_new_tokens <= 6 and cfg.generation.temperature == 1.0
    assert cfg.run.out_dir == "runs/tiny"
    assert cfg.micro_steps_per_update == 1


def test_tiny_fits_the_digit_task_and_mesh():
    tasks = pytest.importorskip("rl.tasks")
    from sharding.mesh import validate
    cfg = load_config(TINY)
    m3, tok = cfg.model.m3_config(), tasks.DigitTokenizer
    assert (m3.bos_token_id, m3.eos_token_id, m3.pad_token_id) == (tok.BOS, tok.EOS, tok.PAD)
    assert cfg.generation.stop_token_ids == (tok.EOS,)
    task = tasks.make_task(cfg.data.task, num_digits=cfg.data.num_digits)
    assert cfg.generation.max_new_tokens >= task.max_new_tokens()
    assert cfg.generation.max_prompt_tokens >= len(task.dataset(1)[0].meta["prompt_ids"])
    validate(cfg.mesh.to_mesh_config(), m3, num_devices=1, batch=cfg.grpo.micro_batch_size)


def test_recipe_holds_the_production_values(recipe_paths):
    cfg = load_config(RECIPE, recipe_paths)
    m, g, o, gen = cfg.mesh, cfg.grpo, cfg.optim, cfg.generation
    assert m.num_devices == 128 and m.context == 8 and m.expert_parallel == 128
    assert m.expert_axes == ("data", "context")
    assert (o.lr, o.weight_decay, o.warmup_steps, o.schedule) == (1e-6, 0.1, 10, "constant")
    # §1's fp32 master, held compact: bf16 param + 16-bit remainder, bitwise the fp32 master's update
    assert (cfg.precision.master, cfg.precision.moment_dtype, cfg.precision.param_dtype) == \
        ("compact", "bfloat16", "bfloat16")
    assert cfg.model.remat and cfg.model.attention_query_chunk == 512 and cfg.model.moe_capacity_factor is None
    assert (g.eps_low, g.eps_high, g.dual_clip) == (0.2, 0.28, 10.0)
    assert (g.is_correction, g.is_cap, g.is_level, g.kl, g.aggregation, g.advantage) == \
        ("truncate", 2.0, "token", "none", "token", "grpo")
    assert (g.prompts_per_step, g.group_size, g.micro_batch_size, g.sequences_per_step) == (32, 16, 1, 512)
    assert (gen.max_prompt_tokens, gen.max_new_tokens, gen.max_seq_len) == (2048, 6144, 8192)
    assert (gen.backend, gen.vllm_tensor_parallel, gen.vllm_expert_parallel, gen.vllm_gpu_memory_utilization) \
        == ("vllm", 16, 16, 0.8)
    assert gen.vllm_servers * gen.vllm_tensor_parallel == 128  # 16 generation nodes x 8
    assert cfg.model.remat
    assert cfg.micro_steps_per_update == 32


def test_recipe_mesh_fits_the_released_model(recipe_paths):
    from m3jax.config import M3Config
    from sharding.mesh import validate
    cfg = load_config(RECIPE, recipe_paths)
    release = M3Config(vocab_size=200064, hidden_size=6144, num_hidden_layers=60, num_attention_heads=64,
                       num_key_value_heads=4, head_dim=128, intermediate_size=3072, dense_intermediate_size=12288,
                       shared_intermediate_size=3072, num_local_experts=128, num_experts_per_tok=4,
                       partial_rotary_factor=0.5, layer_types=["full_attention"] * 3 + ["minimax_m3_sparse"] * 57,
                       mlp_layer_types=["dense"] * 3 + ["sparse"] * 57)
    validate(cfg.mesh.to_mesh_config(), release, num_devices=128, seq_len=cfg.generation.max_seq_len,
             batch=cfg.grpo.micro_batch_size * cfg.mesh.data * cfg.mesh.expert)


def test_recipe_refuses_to_load_without_its_paths():
    msg = load_error(RECIPE)
    assert 'model.path = "???": must be set' in msg and "model.path=..." in msg
    assert "a local Hugging Face model directory" in msg
    assert 'data.path = "???"' in msg and "recipes/m3-32node.yaml" in msg
    assert 'eval.path = "???"' in msg
    msg = load_error(RECIPE, ["model.path=/no/such/dir", "data.path=/no/such.parquet", "eval.path=/no/aime.jsonl"])
    assert "model.path" in msg and "no config.json" in msg and "data.path" in msg and "no such file" in msg
    assert "eval.path = \"/no/aime.jsonl\": no such file" in msg
    msg = load_error(RECIPE, [f"model.path={ROOT}", f"data.path={ROOT}", f"eval.path={ROOT}"])
    # a dataset's folder is no file: "no such file" sent the user looking for a typo
    assert f'data.path = "{ROOT}": a directory, not a file (a dataset folder: name one of its' in msg
    assert f'eval.path = "{ROOT}": a directory, not a file' in msg


def test_recipe_validates_on_a_user_given_aime_style_file(recipe_paths):
    from rl.evaluate import eval_records
    cfg = load_config(RECIPE, recipe_paths)
    e = cfg.eval
    assert e.enabled and e.kind == "file" and e.at_start and e.every_steps == cfg.checkpoint.every_steps
    records = eval_records(cfg)  # every problem of the file, in file order (max_prompts null)
    assert [(r.prompt, r.answer) for r in records] == [("Find x if 2x = 10.", "5"), ("What is 3^2?", "9")]
    assert [r.name for r in cfg.reward] == ["math_verify"] and e.reward == ()  # scored by the run's reward


def test_one_node_config_is_m3_shaped_and_fits_eight_devices():
    from sharding.mesh import validate
    cfg = load_config(ONE_NODE)
    m3 = cfg.model.m3_config()
    assert (m3.vocab_size, m3.hidden_size, m3.num_attention_heads, m3.num_key_value_heads, m3.head_dim) == \
        (200064, 6144, 64, 4, 128)
    assert (m3.intermediate_size, m3.dense_intermediate_size, m3.shared_intermediate_size,
            m3.num_experts_per_tok, m3.rotary_dim) == (3072, 12288, 3072, 4, 64)
    assert (m3.index_n_heads, m3.index_head_dim, m3.index_block_size, m3.index_topk_blocks) == (4, 128, 128, 16)
    assert m3.num_hidden_layers < 60 and m3.num_local_experts < 128
    assert cfg.mesh.num_devices == 8 and cfg.precision.master == "compact"
    wide = load_config(ONE_NODE_128E)
    assert wide.model.m3_config().num_local_experts == 128 and wide.mesh == cfg.mesh
    validate(wide.mesh.to_mesh_config(), wide.model.m3_config(), num_devices=8, seq_len=wide.generation.max_seq_len)
    validate(cfg.mesh.to_mesh_config(), m3, num_devices=8, seq_len=cfg.generation.max_seq_len,
             batch=cfg.grpo.micro_batch_size * cfg.mesh.data * cfg.mesh.expert)
    # the memory estimate in the file's comment: ~22.4 B parameters
    h, n_dense, n_moe = 6144, 3, 5
    attn = h * 64 * 128 * 2 + h * 4 * 128 * 2
    per_expert = 3 * h * 3072
    total = 2 * 200064 * h + n_dense * (attn + 3 * h * 12288) + n_moe * (attn + 65 * per_expert)
    assert 22.0e9 < total < 22.5e9


# ============================================================================== inheritance and merge
def test_base_chain_deep_merge_and_relative_paths(tmp_path):
    write(tmp_path, "root.yaml", """\
        run: {name: root, seed: 1}
        model:
          tiny: {vocab_size: 16, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
                 num_key_value_heads: 1, head_dim: 16, intermediate_size: 32, dense_intermediate_size: 64,
                 shared_intermediate_size: 32, num_local_experts: 4, num_experts_per_tok: 2,
                 layer_types: [full_attention], mlp_layer_types: [dense], bos_token_id: 10, eos_token_id: 12}
        grpo: {prompts_per_step: 4, group_size: 4, micro_batch_size: 2}
        generation: {max_new_tokens: 8, max_prompt_tokens: 8, stop_token_ids: [12, 13]}
        reward: [{name: reverse_digits}, {name: copy_digits, weight: 0.5}]
        """)
    write(tmp_path, "mid/mid.yaml", """\
        base: ../root.yaml
        run: {seed: 2}
        model: {tiny: {hidden_size: 64}}
        generation: {stop_token_ids: [12]}
        """)
    leaf = write(tmp_path, "mid/deeper/leaf.yaml", """\
        base: ../mid.yaml
        grpo: {group_size: 8}
        reward: [{name: sort_digits, timeout_s: 3}]
        """)
    cfg = load_config(leaf)
    assert (cfg.run.name, cfg.run.seed) == ("root", 2)            # scalars: nearest file wins
    assert cfg.model.tiny["hidden_size"] == 64                     # dicts merge ...
    assert cfg.model.tiny["num_local_experts"] == 4                # ... keeping inherited keys
    assert (cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.micro_batch_size) == (4, 8, 2)
    assert cfg.generation.stop_token_ids == (12,)                  # lists replace
    assert cfg.reward == (rc.RewardSpec("sort_digits", 1.0, 3.0),)
    assert cfg.optim == rc.OptimSection()                          # untouched sections: defaults


def test_empty_section_changes_nothing(tmp_path):
    cfg = load_config(delta(tmp_path, "logging:\n"))
    assert cfg.logging == load_config(TINY).logging != rc.LoggingSection()  # tiny.yaml's, not the defaults


# ============================================================================== overrides
def test_overrides_nested_and_typed(tmp_path):
    cfg = load_config(TINY, [
        "grpo.group_size=4",                 # int
        "grpo.micro_batch_size=128",
        "optim.lr=1e-6",                     # float, written without a dot
        "optim.clip_norm=2",                 # an int is accepted for a float ...
        "logging.plot=false",                # bool
        "mesh.expert_axes=[data]",           # list
        "grpo.dual_clip=3.0",
        "optim.clip_norm=null",              # later overrides win; null = off
        "model.tiny.hidden_size=32",         # into the tiny model's dict
        "run.name=try2",
        "checkpoint.must_save_by=23:30",     # a clock time stays a string
        "reward=[{name: reverse_digits, weight: 2}, {name: copy_digits, weight: 0.5, timeout_s: 1}]",
        "generation={temperature: 0.7}",     # a mapping merges into the section
    ])
    assert cfg.grpo.group_size == 4 and cfg.grpo.micro_batch_size == 128 and cfg.grpo.prompts_per_step == 32
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.clip_norm is None
    assert cfg.logging.plot is False and cfg.logging.tensorboard is True
    assert cfg.mesh.expert_axes == ("data",)
    assert cfg.grpo.dual_clip == 3.0
    assert cfg.model.tiny["hidden_size"] == 32 and cfg.model.tiny["vocab_size"] == 16
    assert cfg.run.out_dir == "runs/try2"
    assert cfg.checkpoint.must_save_by == "23:30"
    assert [(r.name, r.weight, r.timeout_s) for r in cfg.reward] == [("reverse_digits", 2.0, 10.0),
                                                                    ("copy_digits", 0.5, 1.0)]
    assert cfg.generation.temperature == 0.7 and cfg.generation.max_new_tokens == 5
    clip = load_config(TINY, ["optim.clip_norm=2"]).optim.clip_norm
    assert clip == 2.0 and isinstance(clip, float)


def test_out_dir_is_derived_from_the_name(tmp_path):
    assert load_config(TINY).run.out_dir == "runs/tiny"
    assert load_config(TINY, ["run.name=x"]).run.out_dir == "runs/x"
    assert load_config(TINY, ["run.out_dir=/scratch/${name}/out", "run.name=y"]).run.out_dir == "/scratch/y/out"
    assert load_config(TINY, ["run.out_dir=elsewhere"]).run.out_dir == "elsewhere"
    msg = load_error(TINY, ["run.out_dir=runs/${user}"])
    assert "run.out_dir" in msg and "only ${name}" in msg
    (tmp_path / "notes").write_text("x")
    for out in (tmp_path / "notes", tmp_path / "notes" / "run"):  # a file, or under one: refused at load
        assert f"run.out_dir = \"{out}\": {tmp_path / 'notes'} is a file; allowed: a directory path" in load_error(
            TINY, [f"run.out_dir={out}"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("x")  # the first save would fail after a step of work
    assert f"{tmp_path / 'run' / 'checkpoints'} is a file" in load_error(TINY, [f"run.out_dir={tmp_path / 'run'}"])
    assert "out of range" in load_error(TINY, [f"run.seed={2 ** 63}"])  # jax's keys take a signed 64-bit seed


def test_a_prompt_file_needs_the_tokenizer_of_a_model_path(tmp_path):
    """A tiny model has no tokenizer to read a prompt file with: refused at load (the trainer used to ask the Hub
    for model `None` and fail after a minute of retries)."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "1234", "answer": "1234"}\n')
    msg = load_error(TINY, ["data.kind=file", f"data.path={tmp_path / 'p.jsonl'}", "eval.every_steps=0",
                            "eval.at_start=false"])
    assert 'data.kind = "file" with model.tiny: a prompt file is read with the model\'s tokenizer' in msg
    # not a path's check: `--print-config`, which skips those (load_config(check_paths=False)), refuses it too
    with pytest.raises(ConfigError, match='data.kind = "file" with model.tiny: a prompt file is read'):
        load_config(TINY, ["data.kind=file", "data.path=p.jsonl", "eval.every_steps=0", "eval.at_start=false"],
                    check_paths=False)


def test_resume_false_refuses_a_directory_that_holds_checkpoints(tmp_path):
    """checkpoint.resume: false means a fresh run only: over an earlier run's checkpoints it would mix the two,
    so loading refuses, naming the directory, before anything is read or written there."""
    out = tmp_path / "run"
    fresh = [f"run.out_dir={out}", "checkpoint.resume=false"]
    assert load_config(TINY, fresh).checkpoint.resume is False  # no directory yet
    (out / "checkpoints").mkdir(parents=True)
    load_config(TINY, fresh)  # an empty checkpoint directory (a run that died before its first save)
    (out / "checkpoints" / rc.DELETED_CHECKPOINTS).mkdir()  # where old steps are removed: no checkpoint
    load_config(TINY, fresh)
    (out / "checkpoints" / rc.DELETED_CHECKPOINTS).rmdir()
    (out / "checkpoints" / "50").mkdir()
    (out / "checkpoints" / "100").mkdir()
    msg = load_error(TINY, fresh)
    assert f"checkpoint.resume = false: {out / 'checkpoints'} already holds checkpoints (100, 50)" in msg
    assert "allowed: true" in msg and "run.name / run.out_dir without checkpoints" in msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["100", "50"]  # untouched
    assert load_config(TINY, [f"run.out_dir={out}"]).checkpoint.resume is True  # the default continues
    assert load_config(TINY, fresh, check_paths=False).checkpoint.resume is False  # --print-config
    assert rc.checkpoint_dir(load_config(TINY, fresh, check_paths=False)) == str(out / "checkpoints")


def test_weight_transport_accepts_only_built_transports():
    assert load_config(TINY).generation.weight_transport == "ray"
    msg = load_error(TINY, ["generation.weight_transport=nccl"])
    assert 'generation.weight_transport = "nccl"' in msg and "ray" in msg


def test_yaml_dialect(tmp_path):
    assert rc.load_yaml("a: 1e-6\nb: 23:30\nc: 010\nd: 0x10\ne: 1_000\nf: .5\ng: -2") == \
        {"a": 1e-6, "b": "23:30", "c": "010", "d": 16, "e": 1000, "f": 0.5, "g": -2}
    cfg = load_config(delta(tmp_path, "optim: {lr: 3e-4}\ncheckpoint: {must_save_by: 07:45}\n"))
    assert cfg.optim.lr == 3e-4 and cfg.checkpoint.must_save_by == "07:45"
    start = dt.datetime(2025, 1, 1, 8, 0)
    assert cfg.checkpoint.deadline_seconds(start) == (23 * 60 + 45) * 60  # 07:45 tomorrow
    assert load_config(TINY, ["checkpoint.must_save_by=3600"]).checkpoint.deadline_seconds(start) == 3600.0


# ============================================================================== print-config round trip
@pytest.mark.parametrize("name", ["tiny", "one_node", "recipe", "overridden"])
def test_print_config_round_trips(tmp_path, recipe_paths, name):
    path, overrides = {"tiny": (TINY, []), "one_node": (ONE_NODE, []), "recipe": (RECIPE, recipe_paths),
                       "overridden": (TINY, ["run.name=odd", "checkpoint.must_save_by=07:05", "optim.lr=1e-7",
                                             "run.out_dir='1e3'", "data.shuffle_seed=5"])}[name]
    cfg = load_config(path, overrides)
    text = to_yaml(cfg)
    printed = write(tmp_path, "printed.yaml", text)
    again = load_config(printed)
    assert again == cfg
    assert to_yaml(again) == text
    assert "base:" not in text and "${name}" not in text


def test_print_config_command_line(tmp_path, capsys):
    """`python -m rl.config` (what --print-config prints), run in-process to keep the suite fast."""
    assert rc.main(["--config", str(TINY), "grpo.group_size=4", "grpo.micro_batch_size=32", "--print-config",
                    "run.name=cli"]) == 0
    printed = write(tmp_path, "printed.yaml", capsys.readouterr().out)
    assert load_config(printed) == load_config(TINY, ["grpo.group_size=4", "grpo.micro_batch_size=32",
                                                      "run.name=cli"])
    assert rc.main(["--config", str(TINY), "grpo.group_sise=4"]) == 2
    assert "grpo.group_sise: unknown key" in capsys.readouterr().err
    # --print-config does not need the recipe's paths to exist, only to be given
    assert rc.main(["--config", str(RECIPE), "model.path=/not/here", "data.path=/nor/here.parquet",
                    "eval.path=/nor/aime.jsonl"]) == 0
    assert "path: /not/here" in capsys.readouterr().out


# ============================================================================== the dataclasses
def test_config_is_frozen_and_replace_revalidates():
    cfg = load_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.grpo.group_size = 4
    ok = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, group_size=4, micro_batch_size=64))
    assert ok.grpo.group_size == 4
    with pytest.raises(ConfigError, match=r"grpo.group_size = 1: out of range; allowed: an integer >= 2"):
        dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, group_size=1))
    with pytest.raises(ConfigError, match=r"reward = \[\]: needs at least 1"):
        RunConfig()  # no reward (and no model)


def test_built_in_code_normalises_like_yaml():
    cfg = load_config(TINY)
    built = RunConfig(run=rc.RunSection(name="tiny", total_steps=200), model=cfg.model,
                      precision=cfg.precision, optim=dataclasses.replace(cfg.optim, lr=1), grpo=cfg.grpo,
                      generation=dataclasses.replace(cfg.generation, stop_token_ids=[12]), data=cfg.data,
                      reward=[rc.RewardSpec("reverse_digits", 1, 5)], checkpoint=cfg.checkpoint)
    assert built.optim.lr == 1.0 and isinstance(built.optim.lr, float)
    assert built.generation.stop_token_ids == (12,) and isinstance(built.reward, tuple)
    assert built.run.out_dir == "runs/tiny"


def test_names_mirrored_from_jax_modules_stay_equal():
    from sharding import precision, rules
    assert rc.TOKEN_AXES == rules.TOKEN_AXES
    assert rc.PRECISION_MODES == precision.MODES
    loss = pytest.importorskip("rl.grpo.loss")
    assert (rc.IS_CORRECTIONS, rc.IS_LEVELS, rc.KL_TYPES, rc.AGGREGATIONS, rc.LOSSES) == \
        (loss.IS_CORRECTIONS, loss.IS_LEVELS, loss.KL_TYPES, loss.AGGREGATIONS, loss.LOSSES)
    adv = pytest.importorskip("rl.grpo.advantages")
    assert set(rc.ADVANTAGES) == set(adv.ADVANTAGE_ESTIMATORS)
    tasks = pytest.importorskip("rl.tasks")
    assert set(rc.DATA_TASKS) == set(tasks.TASKS) and rc.DIGIT_VOCAB == tasks.DigitTokenizer.vocab_size
    assert rc.TASK_REWARDS == {name: task.reward for name, task in tasks.TASKS.items()}
    data = pytest.importorskip("rl.data")
    assert rc.DATA_FORMATS == data.FileFormat.__args__ and rc.DATA_LAYOUTS == data.Layout.__args__
    transfer = pytest.importorskip("rl.generation.transfer")
    assert rc.WEIGHT_TRANSPORTS == tuple(transfer.TRANSPORTS)
    from rl.config import schema
    from rl.generation import vllm_ray  # no vLLM / Ray import: always there
    assert schema.VLLM_EXECUTORS == vllm_ray.EXECUTORS
    from rl import prompt_lengths
    assert schema.OVERLONG_PROMPTS == prompt_lengths.OVERLONG_PROMPTS
    checkpoint = pytest.importorskip("rl.checkpoint")
    assert schema.DELETED_CHECKPOINTS == checkpoint.DELETED


def test_sections_map_onto_their_consumers(recipe_paths):
    pytest.importorskip("rl.grpo.loss")
    cfg = load_config(RECIPE, recipe_paths)
    loss = cfg.grpo.loss_config(cfg.generation.max_new_tokens)
    assert (loss.eps_low, loss.eps_high, loss.dual_clip, loss.is_cap, loss.kl) == (0.2, 0.28, 10.0, 2.0, "none")
    mesh = cfg.mesh.to_mesh_config()
    assert mesh.shape == (16, 8, 1, 1) and mesh.expert_parallel == 128


def test_every_field_is_documented_and_constrained_sensibly():
    def walk(cls):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
            tp = rc._non_none(rc._hints(cls)[f.name])
            if rc._is_section(tp):
                walk(tp)
            item = rc._item_type(tp)
            if item is not None and rc._is_section(item):
                walk(item)
    walk(RunConfig)


def test_vllm_executor_is_checked():
    """generation.vllm_executor (issue 12 item 1): one of auto / mp / ray; ray only for a vLLM server with
    several ranks. The pool resolves auto (rl.generation.vllm_ray.choose_executor; tests/test_vllm_ray_logic.py)."""
    assert load_config(CONFIGS / "tiny-vllm.yaml").generation.vllm_executor == "auto"
    ok = load_config(CONFIGS / "tiny-vllm.yaml", ["generation.vllm_executor=ray", "generation.vllm_tensor_parallel=2"])
    assert ok.generation.vllm_executor == "ray"
    with pytest.raises(ConfigError, match=r'generation.vllm_executor = "uni": not an allowed value; allowed: '
                                          r'one of "auto", "mp", "ray"'):
        load_config(CONFIGS / "tiny-vllm.yaml", ["generation.vllm_executor=uni"])
    with pytest.raises(ConfigError, match=r'generation.vllm_executor = "ray" with backend .vllm. and '
                                          r'vllm_tensor_parallel = 1'):
        load_config(CONFIGS / "tiny-vllm.yaml", ["generation.vllm_executor=ray"])
    with pytest.raises(ConfigError, match=r'generation.vllm_executor = "ray" with backend .jax.'):
        load_config(TINY, ["generation.vllm_executor=ray", "generation.vllm_tensor_parallel=2"])


def test_vllm_expert_parallel_is_one_or_the_tensor_parallel():
    """ep 8 beside tp 16 loaded, and the pool refused it once the model was built."""
    for tp, ep in ((16, 8), (1, 2)):
        with pytest.raises(ConfigError, match=rf"generation.vllm_expert_parallel = {ep} with vllm_tensor_parallel = "
                                              rf"{tp}: .*allowed: 1 or {tp}"):
            load_config(CONFIGS / "tiny-vllm.yaml", [f"generation.vllm_tensor_parallel={tp}",
                                                     f"generation.vllm_expert_parallel={ep}"])
    assert load_config(CONFIGS / "tiny-vllm.yaml", ["generation.vllm_tensor_parallel=2",
                                                    "generation.vllm_expert_parallel=2"])


def test_probe_bound_without_probes_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"generation.verify_max_abs_diff = 0.0001: there is nothing to compare"):
        load_config(CONFIGS / "tiny-vllm.yaml", ["generation.verify_probes=0"])


def test_the_compilation_cache_path_takes_the_run_name_as_out_dir_does():
    """`run.compilation_cache=/scratch/${name}/xla` made a directory literally named ${name}."""
    cfg = load_config(TINY, ["run.compilation_cache=/scratch/${name}/xla", "run.name=trial"])
    assert cfg.run.compilation_cache == "/scratch/trial/xla" and cfg.run.out_dir == "runs/trial"

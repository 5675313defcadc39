"""rl.config: one test per class of bad config file, base chain or override.

Every bad config must fail at load with a message that names the full dotted key (or the file), the
bad value and what is allowed. (Shipped configs, merging and overrides that load: tests/test_run_config.py.)
"""

import pytest

from rl.config import ConfigError, load_config
from tests.test_run_config import TINY, delta, load_error, write


# ============================================================================== bad configs: files
BAD_FILES = {
    # class: (delta over tiny.yaml, substrings the message must hold)
    "unknown_top_level_key": ("trainer: {lr: 1}\n",
                              ["trainer: unknown key", "allowed keys in the top level: run, model, mesh"]),
    "unknown_nested_key": ("grpo: {group_sise: 4}\n",
                           ["grpo.group_sise: unknown key (did you mean 'group_size'?)", "allowed keys in grpo:",
                            "prompts_per_step"]),
    "unknown_tiny_model_key": ("model: {tiny: {hidden_sise: 4}}\n",
                               ["model.tiny.hidden_sise: unknown key (did you mean 'hidden_size'?)",
                                "num_attention_heads"]),
    "unknown_key_in_list_item": ("reward: [{name: copy_digits, wieght: 2}]\n",
                                 ["reward[0].wieght: unknown key (did you mean 'weight'?)", "name, weight, timeout_s"]),
    "bool_for_int": ("grpo: {group_size: true}\n",
                     ["grpo.group_size = true: wrong type (a boolean); allowed: an integer >= 2"]),
    "float_for_int": ("run: {total_steps: 1.5}\n",
                      ["run.total_steps = 1.5: wrong type (a number); allowed: an integer >= 1"]),
    "string_for_float": ("optim: {lr: fast}\n",
                         ['optim.lr = "fast": wrong type (a string); allowed: a number > 0']),
    "int_for_bool": ("logging: {plot: 1}\n",
                     ["logging.plot = 1: wrong type (an integer); allowed: true or false"]),
    "int_for_string": ("run: {name: 7}\n", ['run.name = 7: wrong type (an integer: quote it, as you wrote it, for '
                                            'the text); allowed: letters, digits']),
    # 1e3 was told to quote "1000.0"; a date also gave a second error, out_dir's unknown ${name}
    "float_for_string": ("run: {name: 1e3}\n", ["run.name = 1000.0: wrong type (a number: quote it, as you wrote it"]),
    "date_for_string": ("run: {name: 2024-01-01}\n", ["invalid run config: run.name = "]),  # one problem, not 2
    # YAML's boolean words: the run.out_dir with ${name} was a second error beside it
    "bool_word_for_string": ("run: {name: on}\n", ["invalid run config: run.name = true: wrong type (a boolean: YAML "
                                                   "reads on / off / yes / no as one; quote the word for the text)"]),
    "tiny_layer_types_null": ("model: {tiny: {layer_types: null}}\n",
                              ["model.tiny.layer_types = None is not supported: expected a list of per-layer types"]),
    "scalar_for_list": ("mesh: {expert_axes: data}\n",
                        ['mesh.expert_axes = "data": wrong type (a string); allowed: a list whose items are each '
                         'one of "data", "context", "expert"']),
    "scalar_for_section": ("grpo: 5\n", ["grpo = 5: wrong type (an integer); allowed: a mapping with keys "
                                         "prompts_per_step"]),
    "out_of_range_int": ("grpo: {group_size: 1}\n", ["grpo.group_size = 1: out of range; allowed: an integer >= 2"]),
    "out_of_range_open_interval": ("optim: {b2: 1.0}\n",
                                   ["optim.b2 = 1.0: out of range; allowed: a number in [0, 1)"]),
    "out_of_range_exclusive_min": ("generation: {top_p: 0}\n",
                                   ["generation.top_p = 0.0: out of range; allowed: a number in (0, 1]"]),
    "out_of_range_optional": ("grpo: {dual_clip: 0.5}\n",
                              ["grpo.dual_clip = 0.5: out of range; allowed: null or a number > 1"]),
    "not_finite": ("optim: {lr: .nan}\n", ["optim.lr = NaN: not a finite number; allowed: a number > 0"]),
    # float() of an int past float's range raised an OverflowError traceback from the loader
    "int_past_floats_range": (f"optim: {{lr: 1{'0' * 320}}}\n",
                              ["optim.lr = Infinity: not a finite number; allowed: a number > 0"]),
    "int_past_floats_range_beside_a_clock_time": (f"checkpoint: {{must_save_by: 1{'0' * 320}}}\n",
                                                  ["checkpoint.must_save_by = Infinity: must be a finite number"]),
    "eval_seed_past_64_bits": ("eval: {seed: 9223372036854775808}\n",
                               ["eval.seed = 9223372036854775808: out of range; allowed: an integer in [0, "
                                "9223372036854775807]"]),
    "hang_timeout_past_the_timer": ("run: {hang_timeout_minutes: 2.0e8}\n",
                                    ["run.hang_timeout_minutes = 200000000.0: out of range; allowed: null or a "
                                     "number in (0, 1000000]"]),
    # a helper's fuzz: a step count of 2^31 overflowed in the lr schedule after the run had started, lr = 1e300
    # trained NaN weights, 1e-300 was 0 in float32, a tiny model's vocab past int64 failed in MLIR, and an empty text
    # was taken as unset
    "int_past_int32": ("optim: {warmup_steps: 2147483648}\n",
                       ["optim.warmup_steps = 2147483648: past 2147483647 (2^31 - 1): counts, sizes and steps are "
                        "int32 in the compiled programs; allowed: an integer >= 0"]),
    "list_item_past_int32": ("grpo: {micro_batch_widths: [4294967296]}\n",
                             ["grpo.micro_batch_widths[0] = 4294967296: past 2147483647"]),
    "float_past_float32": ("optim: {lr: 1.0e+300}\n",
                           ["optim.lr = 1e+300: outside float32's range (1.401e-45 to 3.403e+38 in magnitude, or 0)"]),
    "float_below_float32": ("grpo: {entropy_coef: 1.0e-300}\n",
                            ["grpo.entropy_coef = 1e-300: outside float32's range"]),
    "tiny_size_past_int32": ("model: {tiny: {vocab_size: 99999999999999999999}}\n",
                             ["model.tiny.vocab_size = 99999999999999999999 is not supported: expected at most "
                              "2147483647"]),
    "tiny_float_past_float32": ("model: {tiny: {rope_theta: 1.0e+300}}\n",
                                ["model.tiny.rope_theta = 1e+300 is not supported: expected a number from 1.401e-45 "
                                 "to 3.403e+38"]),
    "empty_text_for_optional": ("logging: {wandb_project: ''}\n",
                                ['logging.wandb_project = "": must not be empty (null leaves it unset); allowed: a W&B '
                                 'project name, or null']),
    "blank_coordinator": ("mesh: {coordinator_address: ' '}\n", ['mesh.coordinator_address = " ": must not be empty']),
    "bad_choice": ("grpo: {advantage: ppo}\n",
                   ['grpo.advantage = "ppo": not an allowed value; allowed: one of "grpo", "dr_grpo", "rloo"']),
    "bad_choice_close_match": ("precision: {master: fp23}\n",
                               ['precision.master = "fp23": not an allowed value (did you mean "fp32"?); '
                                'allowed: one of "none", "fp32", "compact"']),
    "bad_list_item_choice": ("mesh: {expert_axes: [data, tensor]}\n",
                             ['mesh.expert_axes[1] = "tensor": not an allowed value; allowed: one of "data", '
                              '"context", "expert"']),
    "repeated_list_item": ("mesh: {expert_axes: [data, data]}\n",
                           ['mesh.expert_axes = ["data", "data"]: has repeated items', "without repeats"]),
    "bad_clock_time": ("checkpoint: {must_save_by: '25:00'}\n",
                       ['checkpoint.must_save_by = "25:00"', "a time 'HH:MM' (24-hour)"]),
    "empty_reward_list": ("reward: []\n", ["reward = []: needs at least 1 item(s); allowed: a non-empty list"]),
    "null_for_required": ("grpo: {group_size: null}\n",
                          ["grpo.group_size = null: must not be null; allowed: an integer >= 2"]),
    "tiny_model_rule": ("model: {tiny: {num_key_value_heads: 3}}\n",
                        ["model.tiny.num_key_value_heads", "a divisor of num_attention_heads=4"]),
    "tiny_token_id_outside_vocab": ("model: {tiny: {eos_token_id: 16}}\n",
                                    ["model.tiny.eos_token_id = 16: not a token id of the model; allowed: null or "
                                     "an integer in [0, vocab_size=16)"]),
    # cross-field rules
    "batch_not_divisible": ("grpo: {micro_batch_size: 3}\n",
                            ["grpo.micro_batch_size = 3", "32 prompts x 8 samples = 256 sequences",
                             "allowed: values with prompts_per_step x group_size divisible by updates_per_step x "
                             "mesh.data x mesh.expert x micro_batch_size (here 3)"]),
    "batch_not_divisible_over_mesh": ("grpo: {micro_batch_size: 256}\nmesh: {data: 2}\n",
                                      ["grpo.micro_batch_size = 256", "mesh.data x mesh.expert = 2",
                                       "micro_batch_size (here 512)"]),
    "model_path_and_tiny": ("model: {path: /some/model}\n",
                            ["model.path = \"/some/model\" and model.tiny = {...}: both are set; allowed: exactly "
                             "one of model.path"]),
    "model_neither": ("model: {tiny: null}\n", ["model.tiny = null: neither is set; allowed: exactly one"]),
    "kl_coef_without_kl": ("grpo: {kl_coef: 0.1}\n",
                           ['grpo.kl_coef = 0.1: has no effect with grpo.kl = "none"; allowed: 0, or set grpo.kl']),
    "kl_without_coef": ("grpo: {kl: k3}\n", ['grpo.kl_coef = 0 with grpo.kl = "k3"', "allowed: a number > 0"]),
    "file_data_without_path": ("data: {kind: file}\n",
                               ['data.path = null: data.kind = "file" needs a prompt file; allowed: a path']),
    "path_with_synthetic_data": ("data: {path: x.jsonl}\n",
                                 ['data.path = "x.jsonl": data.kind = "synthetic" reads no file; allowed: null']),
    # a helper's audit: these passed and were ignored (a prompt_key meant for a file the config forgot to name)
    "file_settings_with_synthetic_data": ("data: {prompt_key: question, layout: gsm8k, chat_template: true}\n",
                                          ['data.prompt_key = "question": data.kind = "synthetic" reads no file; '
                                           'allowed: null, or set data.kind = "file"',
                                           'data.layout = "gsm8k": data.kind = "synthetic" reads no file; allowed: '
                                           '"auto"', "data.chat_template = true: data.kind"]),
    # a helper's audit: NaN log-probs on the JAX engine, from the first step
    # an audit: greedy sampling by top_k trained nothing for a whole run (every log-prob 0), without a word
    "top_k_of_one": ("generation: {top_k: 1}\n",
                     ["generation.top_k = 1: sampling keeps the one most likely token", "allowed: 0 (off) or an "
                      "integer >= 2"]),
    "temperature_that_overflows": ("generation: {temperature: 1.0e-38}\n",
                                   ["generation.temperature = 1e-38: logits / temperature overflow float32 (every "
                                    "log-prob NaN); allowed: 0 (greedy, eval only) or >= 1e-30"]),
    "file_settings_with_synthetic_eval": ("eval: {answer_key: a, format: jsonl}\n",
                                          ['eval.answer_key = "a": eval.kind = "synthetic" reads no file; allowed: '
                                           'null, or set eval.kind = "file"', 'eval.format = "jsonl": eval.kind']),
    "answer_longer_than_generation": ("data: {num_digits: 8}\n",
                                      ["generation.max_new_tokens = 5", "answers need 9 tokens",
                                       "allowed: an integer >= 9", "generation.max_prompt_tokens = 8"]),
    "sequence_past_the_positions": ("generation: {max_new_tokens: 100}\n",
                                    ["generation.max_prompt_tokens + generation.max_new_tokens = 8 + 100 = 108: more "
                                     "positions than the model has (max_position_embeddings = 64, from "
                                     "model.tiny.max_position_embeddings); allowed: prompt + response limits of at "
                                     "most 64 tokens"]),
    "eval_sequence_past_the_positions": ("eval: {max_new_tokens: 57}\n",
                                         ["eval.max_prompt_tokens + eval.max_new_tokens = 8 + 57 = 65: more "
                                          "positions than the model has (max_position_embeddings = 64"]),
    "stop_token_outside_vocab": ("generation: {stop_token_ids: [12, 99]}\n",
                                 ["generation.stop_token_ids[1] = 99: not a token of the model; allowed: an integer "
                                  "in [0, model.tiny.vocab_size=16)"]),
    "process_id_past_num_processes": ("mesh: {num_processes: 2, process_id: 2}\n",
                                      ["mesh.process_id = 2: not below mesh.num_processes = 2; allowed: an integer "
                                       "in [0, 2)"]),
    "more_processes_than_devices": ("mesh: {num_processes: 2}\n",
                                    ["mesh.num_processes = 2 with a mesh of 1 device(s): every process holds devices "
                                     "of the mesh"]),
    "fsdp_step_axes_not_a_tail": ("mesh: {fsdp_axes: [data, context], fsdp_step_axes: [data]}\n",
                                  ['mesh.fsdp_step_axes = ["data"]: not the last entries of mesh.fsdp_axes = '
                                   '["data", "context"]; allowed: [] or a proper tail of fsdp_axes']),
    "fsdp_step_axes_all_of_them": ("mesh: {fsdp_step_axes: [data]}\n",
                                   ['mesh.fsdp_step_axes = ["data"]: all of mesh.fsdp_axes = ["data"]']),
    "reward_twice": ("reward: [{name: copy_digits}, {name: copy_digits}]\n",
                     ['reward[1].name = "copy_digits": listed twice; allowed: each reward once']),
    "reward_not_registered": ("reward: [{name: reverse_digit}]\n",
                              ['reward[0].name = "reverse_digit": no reward is registered under this name (did you '
                               'mean "reverse_digits"?); allowed: one of', '"math_verify"', "register_reward"]),
    # a weight past 1e6 could take the float32 reward sum to inf; a process-mode wait past ~2.1e6 s overflowed
    "reward_weight_too_large": ("reward: [{name: copy_digits, weight: 1e300}]\n",
                                ["reward[0].weight = 1e+300: out of range; allowed: a number in [-1000000, 1000000]"]),
    "reward_timeout_too_large": ("reward: [{name: copy_digits, timeout_s: 1e7}]\n",
                                 ["reward[0].timeout_s = 10000000.0: out of range; allowed: a number in (0, 1000000]"]),
    "mask_band_empty": ("grpo: {is_correction: mask, is_mask_low: 2.0, is_mask_high: 1.5}\n",
                        ["grpo.is_mask_high = 1.5: not above grpo.is_mask_low = 2.0; allowed: a number > "
                         "is_mask_low"]),
    "loss_unknown": ("grpo: {loss: gpso}\n", ['grpo.loss = "gpso": not an allowed value (did you mean "gspo"?)']),
    "dual_clip_without_ppo_clip": ("grpo: {loss: cispo, dual_clip: 10.0}\n",
                                   ['grpo.dual_clip = 10.0: has no effect with grpo.loss = "cispo"']),
    "cispo_eps_low_without_cispo": ("grpo: {loss: gspo, cispo_eps_low: 0.2}\n",
                                    ['grpo.cispo_eps_low = 0.2: has no effect with grpo.loss = "gspo"']),
    "sequence_sum_len_without_sequence_sum": ("grpo: {aggregation: sequence_mean, sequence_sum_len: 4}\n",
                                              ['grpo.sequence_sum_len = 4: has no effect with grpo.aggregation = '
                                               '"sequence_mean"']),
    "is_floor_without_truncate": ("grpo: {is_correction: mask, is_floor: 0.5}\n",
                                  ['grpo.is_floor = 0.5: has no effect with grpo.is_correction = "mask"']),
    "is_floor_above_cap": ("grpo: {is_floor: 3.0}\n", ["grpo.is_floor = 3.0: not below grpo.is_cap = 2.0"]),
    "kl_on_policy_without_kl": ("grpo: {kl_on_policy: true}\n", ['grpo.kl_on_policy = true: there is no KL term']),
    "indexer_replay_without_block_ids": ("grpo: {indexer_replay: rollout}\ngeneration: {backend: vllm}\n",
                                         ['grpo.indexer_replay = "rollout" with generation.backend = "vllm": this '
                                          "vLLM version does not return the indexer's block selection",
                                          'allowed: "none", or generation.backend = "jax"']),
    "vllm_temperature_it_would_raise": ("generation: {backend: vllm, temperature: 0.005}\n"
                                        "eval: {every_steps: 5, temperature: 0.001, samples_per_prompt: 1}\n",
                                        ['generation.temperature = 0.005 with generation.backend = "vllm": vLLM '
                                         "raises a temperature below 0.01 to 0.01", "eval.temperature = 0.001",
                                         "allowed: 0 (greedy, eval only) or >= 0.01"]),
    "indexer_loss_without_sparse_layers": ("model: {indexer_loss_coef: 0.1, tiny: {layer_types: [full_attention, "
                                           "full_attention]}}\n",
                                           ["model.indexer_loss_coef = 0.1: the model has no sparse (indexer) layers",
                                            "allowed: 0"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_config_is_rejected_with_key_value_and_allowed(tmp_path, case):
    body, expected = BAD_FILES[case]
    msg = load_error(delta(tmp_path, body))
    for s in expected:
        assert s in msg, f"{case}: {s!r} not in\n{msg}"
    assert "run.yaml" in msg  # names the file that set the value


def test_every_problem_is_reported_at_once(tmp_path):
    msg = load_error(delta(tmp_path, """\
        grpo: {group_sise: 4, advantage: ppo}
        optim: {lr: -1.0}
        logging: {plot: yes please}
        """))
    assert "4 problems" in msg
    for key in ("grpo.group_sise", "grpo.advantage", "optim.lr", "logging.plot"):
        assert key in msg


def test_error_names_the_file_or_override_that_set_the_value(tmp_path):
    msg = load_error(delta(tmp_path, "grpo: {group_size: 1}\n"), ["optim.lr=0"])
    assert "grpo.group_size = 1" in msg and "[set by" in msg and "run.yaml]" in msg
    assert "optim.lr = 0.0: out of range" in msg and "[set by override 'optim.lr=0']" in msg


def test_duplicate_key_in_a_file(tmp_path):
    msg = load_error(delta(tmp_path, "optim:\n  lr: 1.0e-3\n  lr: 1.0e-4\n"))
    assert "run.yaml:4:" in msg and "'lr' appears twice" in msg  # line 1 is the base


def test_keys_merged_from_an_anchor_are_overridden_not_repeats(tmp_path):
    """`{<<: *r, timeout_s: 2.0}` was refused as 'timeout_s' appearing twice (checked after the merge)."""
    cfg = load_config(delta(tmp_path, """
        reward:
          - &r {name: copy_digits, weight: 1.0, timeout_s: 5.0}
        eval:
          reward:
            - {<<: *r, timeout_s: 2.0}
        """))
    assert cfg.eval.reward[0].timeout_s == 2.0 and cfg.eval.reward[0].name == "copy_digits"
    msg = load_error(delta(tmp_path, "optim:\n  <<: {lr: 1.0e-3}\n  clip_norm: 1.0\n  clip_norm: 2.0\n"))
    assert "'clip_norm' appears twice" in msg  # the mapping's own keys still count


@pytest.mark.parametrize("text", ["0x_", "0o_"])
def test_a_base_prefix_without_digits_is_text_not_a_traceback(text):
    """int('0x', 0) raised ValueError out of the loader (a traceback); now it is a string, refused by name."""
    with pytest.raises(ConfigError, match=f"optim.lr = \"{text}\""):
        load_config(TINY, [f"optim.lr={text}"])


# ============================================================================== bad configs: files and chains
def test_base_cycle(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: sub/c.yaml\n")
    write(tmp_path, "sub/c.yaml", "base: ../a.yaml\n")
    msg = load_error(tmp_path / "a.yaml")
    assert "base: cycle of config files" in msg
    assert "a.yaml -> " in msg and "b.yaml -> " in msg and "c.yaml -> " in msg and msg.rstrip().count("a.yaml") >= 2
    write(tmp_path, "self.yaml", "base: self.yaml\n")
    assert "cycle" in load_error(tmp_path / "self.yaml")


def test_missing_base_file(tmp_path):
    p = write(tmp_path, "child.yaml", "base: nowhere/parent.yaml\n")
    msg = load_error(p)
    assert "base: " in msg and "parent.yaml" in msg and "(named by" in msg and "child.yaml" in msg
    assert "does not exist" in msg and "allowed: a YAML file path relative to the file that names it" in msg
    assert "config file" in load_error(tmp_path / "absent.yaml") and "does not exist" in load_error(
        tmp_path / "absent.yaml")


def test_a_config_file_that_is_not_text(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    assert "is not UTF-8 text (byte 0); allowed: a YAML file" in load_error(tmp_path / "bin.yaml")


def test_base_of_wrong_type(tmp_path):
    msg = load_error(write(tmp_path, "x.yaml", "base: [a.yaml]\n"))
    assert "base = [\"a.yaml\"]" in msg and "wrong type (a list)" in msg and "relative to this one" in msg


def test_malformed_yaml(tmp_path):
    p = write(tmp_path, "bad.yaml", "run:\n  name: x\n  seed: [1, 2\ngrpo: {}\n")
    msg = load_error(p)
    assert "bad.yaml:" in msg and "malformed YAML" in msg
    p = write(tmp_path, "indent.yaml", "run:\n  name: x\n seed: 1\n")
    msg = load_error(p)
    assert "indent.yaml:3:" in msg and "malformed YAML" in msg


def test_top_level_not_a_mapping(tmp_path):
    msg = load_error(write(tmp_path, "list.yaml", "- run\n- model\n"))
    assert "list.yaml: the top level is a list; allowed: a mapping of sections (run, model" in msg


# ============================================================================== bad overrides
BAD_OVERRIDES = {
    "unknown_key": ("grpo.group_sise=4", ["override 'grpo.group_sise=4'", "grpo.group_sise: unknown key "
                                          "(did you mean 'group_size'?)", "allowed keys in grpo:"]),
    "unknown_section": ("grop.group_size=4", ["grop: unknown key (did you mean 'grpo'?)",
                                              "allowed keys in the top level: run, model"]),
    "unknown_tiny_key": ("model.tiny.hidden=3", ["model.tiny.hidden: unknown key (did you mean 'hidden_size'?)"]),
    "unparsable_value": ("grpo.group_size=[1,2", ["override 'grpo.group_size=[1,2'", "the value '[1,2' for "
                                                  "grpo.group_size is not valid YAML",
                                                  "allowed: an integer >= 2"]),
    "unparsable_mapping": ("generation={temperature: 1", ["generation is not valid YAML",
                                                         "allowed: a mapping with keys backend"]),
    "no_equals_sign": ("grpo.group_size", ["override 'grpo.group_size': expected key.sub=value"]),
    "empty_key_part": ("grpo..group_size=2", ["expected key.sub=value"]),
    "sub_key_of_scalar": ("optim.lr.x=1", ["optim.lr is a number > 0, it has no sub-keys; allowed: optim.lr=<value>"]),
    "sub_key_of_list": ("reward.name=x", ["reward is a list, so it has no sub-keys", "name, weight, timeout_s"]),
    "wrong_type_value": ("grpo.group_size=four", ['grpo.group_size = "four": wrong type (a string); allowed: an '
                                                  "integer >= 2 [set by override 'grpo.group_size=four']"]),
    "bad_choice_value": ("generation.backend=sglang", ['generation.backend = "sglang": not an allowed value; '
                                                       'allowed: one of "jax", "vllm"']),
}


@pytest.mark.parametrize("case", sorted(BAD_OVERRIDES))
def test_bad_override_is_rejected(case):
    override, expected = BAD_OVERRIDES[case]
    msg = load_error(TINY, [override])
    for s in expected:
        assert s in msg, f"{case}: {s!r} not in\n{msg}"


def test_stop_tokens_outside_a_checkpoint_vocabulary(tmp_path):
    """model.path: the stop tokens (generation.stop_token_ids, or the model's end tokens when that list is empty:
    generation_config.json's eos_token_id, else config.json's) must be below config.json's vocab_size, or no
    response would ever stop; a generation_config.json that does not read is one problem naming it."""
    import json

    from rl.config import load_config
    from tests.test_run_config import TINY
    hf = load_config(TINY).model.m3_config().to_hf_dict()
    model = tmp_path / "model"
    model.mkdir()
    path = ["model.tiny=null", f"model.path={model}", "generation.stop_token_ids=[]"]  # tiny.yaml names <eos>
    for eos in (99, [2, 99]):
        (model / "config.json").write_text(json.dumps({**hf, "eos_token_id": eos}))
        msg = load_error(TINY, path)
        assert (f"generation.stop_token_ids = []: responses would stop at the model's end token(s) "
                f"{eos if isinstance(eos, list) else [eos]} ({model}'s generation_config.json eos_token_id, else its "
                f"config.json's), but 99 is not below its vocab_size = 16") in msg, msg
        assert load_config(TINY, path + ["generation.stop_token_ids=[12]"]).generation.stop_token_ids == (12,)
    (model / "config.json").write_text(json.dumps(hf))
    assert load_config(TINY, path).model.path == str(model)
    msg = load_error(TINY, path + ["generation.stop_token_ids=[12,16]"])
    assert (f"generation.stop_token_ids[1] = 16: not a token of the model; allowed: an integer in [0, vocab_size in "
            f"{model}/config.json=16)") in msg, msg
    (model / "generation_config.json").write_text('{"eos_token_id": [12, 40]}')
    assert "end token(s) [12, 40]" in load_error(TINY, path)
    (model / "generation_config.json").write_text('{"eos_token_id": "<eos>"}')
    assert f"{model}/generation_config.json: eos_token_id = '<eos>'; expected a token id" in load_error(TINY, path)
    (model / "generation_config.json").write_text('{"eos_token_id": ')
    assert f"{model}/generation_config.json: not a readable JSON file" in load_error(TINY, path)


def test_no_token_to_end_a_response_is_refused(tmp_path):
    """generation.stop_token_ids empty and a model that names no end token: every response ran to max_new_tokens and
    counted as truncated (all filtered under grpo.overlong_filter), with nothing said (a helper's audit)."""
    import json

    from rl.config import load_config
    from tests.test_run_config import TINY
    tiny = ["generation.stop_token_ids=[]", "model.tiny.eos_token_id=null"]
    assert ("generation.stop_token_ids = [] and model.tiny.eos_token_id names no token: no token ends a response, so "
            "every response would run to generation.max_new_tokens = 5 and be truncated") in load_error(TINY, tiny)
    assert load_config(TINY, tiny[1:]).generation.stop_token_ids == (12,)  # the config's own stop token
    hf = load_config(TINY).model.m3_config().to_hf_dict()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**hf, "eos_token_id": None}))
    path = ["model.tiny=null", f"model.path={model}", "generation.stop_token_ids=[]"]
    assert (f"generation.stop_token_ids = [] and {model} names no eos_token_id (in generation_config.json or "
            "config.json): no token ends a response") in load_error(TINY, path)
    (model / "generation_config.json").write_text('{"eos_token_id": 12}')
    assert load_config(TINY, path).model.path == str(model)


def test_a_checkpoints_end_tokens_are_its_generation_configs(tmp_path):
    """As transformers' generate and vLLM: generation_config.json's eos_token_id where it sets one (a chat model's
    end-of-turn token beside config.json's eos), else config.json's; the run's sampling stops at them when
    generation.stop_token_ids is empty."""
    from types import SimpleNamespace

    from m3jax.hf.end_tokens import end_token_ids
    from rl.generation.backends import model_end_tokens, sampling_of
    from rl.config import load_config
    from tests.test_run_config import TINY
    assert end_token_ids(tmp_path, 2) == (2,) and end_token_ids(tmp_path, None) == ()
    (tmp_path / "generation_config.json").write_text('{"do_sample": true}')
    assert end_token_ids(tmp_path, (2, 5)) == (2, 5)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert end_token_ids(tmp_path, 2) == (2, 7)
    path_model = SimpleNamespace(path=str(tmp_path), tiny=None)
    assert model_end_tokens(path_model, 2) == (2, 7)
    assert model_end_tokens(SimpleNamespace(path=None, tiny={}), 12) == (12,)
    cfg = load_config(TINY, ["generation.stop_token_ids=[]"])
    assert sampling_of(cfg, model_end_tokens(path_model, 2)).stop_token_ids == (2, 7)


def test_the_tokenizers_eos_ends_a_response_too_as_vllm_stops(tmp_path):
    """vLLM stops at the tokenizer's eos token (its "primary" EOS) beside generation_config.json's: a chat model
    whose template ends each turn with a token its configs do not name (config and generation config eos 1, the
    tokenizer's eos <|eot_id|> 4) sampled on past the turn's end to max_new_tokens here (an audit)."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rl.generation.backends import model_end_tokens
    vocab = {"<pad>": 0, "<|end_of_text|>": 1, "<unk>": 2, "hi": 3, "<|eot_id|>": 4}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                            eos_token="<|eot_id|>").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 1}')
    model = SimpleNamespace(path=str(tmp_path), tiny=None)
    assert model_end_tokens(model, 1) == (1, 4)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 4]}')
    assert model_end_tokens(model, 1) == (1, 4)  # named once


@pytest.mark.parametrize("overrides", [["grpo=3", "grpo.group_size=4"], ["grpo=", "grpo.group_size=4"],
                                       ["grpo=[1]"]])
def test_a_value_for_a_section_is_refused_not_a_reset(overrides):
    """grpo=3 followed by a grpo key reset the whole section to its defaults, silently."""
    msg = load_error(TINY, overrides)
    assert f"override {overrides[0]!r}: grpo is a section, so it takes its keys (grpo.<key>=value)" in msg


def test_an_empty_section_inherits(tmp_path):
    """`grpo:` with nothing under it replaced the base's grpo with the schema's defaults, silently."""
    from rl.config import load_config
    tiny = load_config(TINY)
    got = load_config(delta(tmp_path, "grpo:\nrun:\n  name: emptysec\n"))
    assert got.grpo == tiny.grpo and got.run.name == "emptysec"
    assert load_config(TINY, ["grpo={}"]).grpo == tiny.grpo


def test_cut_micro_batches_under_context_parallelism_with_a_capacity_are_refused():
    """A cut moves positions between context shards, and the capacity bounds each device's own assignments: the cut
    micro-batch dropped other (token, expert) pairs than the full width (real tokens' logits 0.38 apart, an audit's
    run), where grpo.micro_batch_widths promises the same values. Each of the three settings alone is fine."""
    bad = ["mesh.context=2", "grpo.micro_batch_widths=[64]", "model.moe_capacity_factor=1.0"]
    msg = load_error(TINY, bad)
    assert ("grpo.micro_batch_widths = [64] with mesh.context = 2 and model.moe_capacity_factor = 1: a micro-batch cut "
            "to a width puts other positions on each context shard") in msg, msg
    assert "allowed: [] (no cut), mesh.context = 1, or model.moe_capacity_factor = null (dropless)" in msg, msg
    for fine in ("mesh.context=1", "grpo.micro_batch_widths=[]", "model.moe_capacity_factor=null"):
        load_config(str(TINY), [*bad, fine], check_paths=False)

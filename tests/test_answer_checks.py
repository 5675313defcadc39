"""A prompt file whose answers a reward cannot score is refused as it loads, naming the row (rl.answer_checks): a
code dataset read with its reference `solution` as the answer (the detected field before its tests) trained for
its whole length with every sample failing (an audit, 2026-12-08)."""

import json

import pytest

from rl.answer_checks import check_answers
from rl.data import DatasetError, records_from_rows

TESTS = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
SOLUTION = "def f():\n    return 1"


def test_rows_whose_answers_are_tests_pass_and_a_reference_program_is_refused_at_its_row():
    good = records_from_rows([{"problem": "echo", "answer": TESTS}] * 2, source="code.jsonl")
    check_answers(good, ["code_tests", "code_tests_frac"], "code.jsonl", "data.answer_key")
    rows = [{"problem": "echo", "solution": TESTS}, {"problem": "f", "solution": SOLUTION}]
    with pytest.raises(DatasetError, match=r"code.jsonl, row 2: reward 'code_tests_frac' cannot score against this "
                                           r"row's answer: code tests: .*chosen by data.answer_key"):
        check_answers(records_from_rows(rows, source="code.jsonl"), ["code_tests_frac"], "code.jsonl",
                      "data.answer_key")


def test_math_verify_refuses_a_list_of_accepted_answers_and_takes_intervals_and_one_item_lists():
    """A dataset's list of several answers became JSON text, which math_verify scored 0 for every response (an audit:
    '["3", "three"]' against \\boxed{3}); an interval [0, 1] and a one-item list score as they should."""
    from rl.rewards.math import math_verify_reward
    rows = [{"problem": "p", "answer": a} for a in ([0, 1], ["2"], "[0, 1)", "{1, 2}", "3")]
    check_answers(records_from_rows(rows, source="m.jsonl"), ["math_verify"], "m.jsonl", "data.answer_key")
    assert math_verify_reward("\\boxed{[0,1]}", "[0, 1]") == 1.0 and math_verify_reward("\\boxed{2}", '["2"]') == 1.0
    assert math_verify_reward("\\boxed{3}", '["3", "three"]') == 0.0  # what the check spares a run from
    for bad, what in ((["3", "three"], "list of 2 items"), ({"value": 3}, "JSON object")):
        records = records_from_rows([{"problem": "p", "answer": "3"}, {"problem": "p", "answer": bad}],
                                    source="m.jsonl")
        with pytest.raises(DatasetError, match=rf"m.jsonl, row 2: reward 'math_verify' cannot score against this "
                                               rf"row's answer: math_verify: the answer is a {what}"):
            check_answers(records, ["math_verify"], "m.jsonl", "data.answer_key")


def test_a_reward_without_rules_for_answers_takes_any():
    records = records_from_rows([{"problem": "f", "solution": SOLUTION}], source="code.jsonl")
    check_answers(records, ["math_verify"], "code.jsonl", "data.answer_key")


def test_the_run_and_its_evaluation_refuse_such_a_file_before_training(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rl.config import load_config
    from rl.evaluate import eval_records
    from rl.prompt_loader import build_data
    from tests.test_run_config import TINY

    words = ["<pad>", "<unk>", "<eos>", "echo", "f"]
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(load_config(TINY).model.m3_config().to_hf_dict()))
    bad = tmp_path / "code.jsonl"
    bad.write_text(json.dumps({"problem": "f", "solution": SOLUTION}) + "\n")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"problem": "echo", "answer": TESTS}) + "\n")
    common = ["model.tiny=null", f"model.path={tmp_path}", "grpo.prompts_per_step=2", "grpo.micro_batch_size=16",
              "data.chat_template=false", "reward=[{name: code_tests}]"]
    train = ["data.kind=file", f"data.path={bad}", "eval.every_steps=0", "eval.at_start=false"]
    with pytest.raises(DatasetError, match=rf"{bad}, row 1: reward 'code_tests' .*data.answer_key"):
        build_data(load_config(TINY, [*common, *train]))
    held_out = ["data.kind=file", f"data.path={good}", "eval.kind=file", f"eval.path={bad}"]
    with pytest.raises(DatasetError, match=rf"{bad}, row 1: reward 'code_tests' .*eval.answer_key"):
        eval_records(load_config(TINY, [*common, *held_out]))

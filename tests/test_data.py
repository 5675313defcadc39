"""rl.data: prompt files in the common math-RL layouts, one clear error per bad row, chat rendering,
and a loader whose position survives a checkpoint."""

import json

import numpy as np
import pytest

from rl.data import DatasetError, PromptRecord, load_prompts, render_prompt
from rl.prompt_lengths import fit_prompt_lengths
from rl.prompt_loader import PromptLoader
from rl.tasks import DigitTokenizer, ReverseDigitsTask


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"content": "Solve 1+1. Answer: $Answer", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a1"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"content": "You are terse.", "role": "system"}, {"content": "Half of 1?", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a2"},
    },
]


# ------------------------------------------------------------------------------------------ formats

def test_dapo_jsonl(tmp_path):
    recs = load_prompts(write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS))
    assert len(recs) == 2 and all(isinstance(r, PromptRecord) for r in recs)
    assert recs[0].prompt == [{"role": "user", "content": "Solve 1+1. Answer: $Answer"}]
    assert recs[1].prompt[0]["role"] == "system" and recs[1].answer == "\\frac{1}{2}"
    assert recs[0].answer == "2"
    assert recs[0].meta["layout"] == "dapo" and recs[0].meta["row"] == 1
    assert recs[0].meta["data_source"] == "math_dapo" and "prompt" not in recs[0].meta


def test_gsm8k_jsonl(tmp_path):
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "How many cents in 12.34 dollars times 100?", "answer": "Work...\n#### 1,234"},
    ]
    recs = load_prompts(write_jsonl(tmp_path / "gsm8k.jsonl", rows))
    assert [r.answer for r in recs] == ["7", "1234"]
    assert recs[0].prompt.startswith("Tom has") and recs[0].meta["layout"] == "gsm8k"
    assert "#### 7" in recs[0].meta["answer"]  # the worked solution stays available


def test_plain_jsonl_and_numeric_answer(tmp_path):
    p = tmp_path / "plain.jsonl"
    p.write_text('{"prompt": "What is 6*7?", "answer": "42"}\n\n{"prompt": "2+2?", "answer": 4}\n')
    recs = load_prompts(p)
    assert [(r.prompt, r.answer) for r in recs] == [("What is 6*7?", "42"), ("2+2?", "4")]
    assert recs[1].meta["row"] == 3  # JSONL rows are line numbers (blank lines skipped)


def test_a_float_answer_is_kept_as_written_not_in_exponent_form(tmp_path):
    """str(0.00001) is '1e-05', which math_verify reads as e - 5 (Euler's number): a right answer scored 0."""
    from rl.rewards.math import math_verify_reward
    p = tmp_path / "small.jsonl"
    p.write_text('{"prompt": "a", "answer": 0.00001}\n{"prompt": "b", "answer": 1e20}\n'
                 '{"prompt": "c", "answer": 2.5}\n')
    assert [r.answer for r in load_prompts(p)] == ["0.00001", "100000000000000000000", "2.5"]
    assert math_verify_reward("so \\boxed{0.00001}", "0.00001") == 1.0


def test_json_array_and_case_insensitive_columns(tmp_path):
    p = tmp_path / "aime.json"
    p.write_text(json.dumps([{"ID": "2024-I-1", "Problem": "Find x.", "Answer": 204}]))
    (rec,) = load_prompts(p)
    assert rec.prompt == "Find x." and rec.answer == "204" and rec.meta["ID"] == "2024-I-1"


def test_explicit_dotted_keys_override_detection(tmp_path):
    rows = [{"prompt": "ignored", "text": "Real prompt", "labels": {"final": "9"}, "answer": "wrong"}]
    (rec,) = load_prompts(write_jsonl(tmp_path / "x.jsonl", rows), prompt_key="text", answer_key="labels.final")
    assert rec.prompt == "Real prompt" and rec.answer == "9"


def test_parquet_dapo(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet support needs the 'pyarrow' package")
    import pyarrow.parquet as pq

    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(DAPO_ROWS), path)
    recs = load_prompts(path)
    assert [r.answer for r in recs] == ["2", "\\frac{1}{2}"]
    assert recs[1].prompt == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Half of 1?"}]
    assert recs[0].meta["extra_info"] == {"index": "a1"}


def test_a_float32_parquet_answer_is_the_number_as_written(tmp_path):
    """to_pylist widened float32 123.456 to 123.45600128173828, the answer's text: a right \\boxed{123.456}
    scored 0. Top-level and nested (DAPO's reward_model.ground_truth) columns alike."""
    pa = pytest.importorskip("pyarrow", reason="Parquet support needs the 'pyarrow' package")
    import pyarrow.parquet as pq

    gt = pa.struct([("ground_truth", pa.float32()), ("style", pa.string())])
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": pa.array([123.456, 0.1], pa.float32()),
                             "reward_model": pa.array([{"ground_truth": 1.1, "style": "rule"},
                                                       {"ground_truth": 2.5, "style": None}], gt)}),
                   tmp_path / "f32.parquet")
    assert [r.answer for r in load_prompts(tmp_path / "f32.parquet", answer_key="answer")] == ["123.456", "0.1"]
    recs = load_prompts(tmp_path / "f32.parquet", answer_key="reward_model.ground_truth")
    assert [r.answer for r in recs] == ["1.1", "2.5"]


# ------------------------------------------------------------------------------------------ errors

def check_error(excinfo, path, row):
    msg = str(excinfo.value)
    assert str(path) in msg
    if row is not None:
        assert f"row {row}" in msg, msg
    assert excinfo.value.path == str(path) and excinfo.value.row == row
    return msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "not found" in check_error(e, path, None)


def test_invalid_json_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"prompt": "c", "answer": \n')
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "invalid JSON" in check_error(e, path, 3)


def test_a_line_cut_short_says_so_not_column_1(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "the line ends early" in check_error(e, path, 2)


@pytest.mark.parametrize("text, says", [
    ('{"prompt": "a", "answer": ' + "9" * 5000 + "}", "4300 digits"),
    ('{"prompt": "a", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_json_past_the_readers_limits_names_the_row(tmp_path, text, says):
    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n' + text + "\n")
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert says in check_error(e, path, 2)
    path = tmp_path / "big.json"
    path.write_text("[" + text + "]")
    with pytest.raises(DatasetError, match=says):
        load_prompts(path)


def test_a_key_twice_in_a_row_is_refused_and_a_byte_order_mark_is_read(tmp_path):
    """json keeps the last of two equal keys silently: a row's answer could be the wrong one."""
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "1", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl, row 2: the key 'answer' appears twice in one object"):
        load_prompts(tmp_path / "d.jsonl")
    (tmp_path / "d.json").write_text('[{"prompt": "a", "prompt": "b", "answer": "1"}]')
    with pytest.raises(DatasetError, match=r"d.json: the key 'prompt' appears twice"):
        load_prompts(tmp_path / "d.json")
    for name in ("bom.jsonl", "bom.json"):  # was "Unexpected UTF-8 BOM"
        body = '{"prompt": "a", "answer": "1"}' if name.endswith("l") else '[{"prompt": "a", "answer": "1"}]'
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert [(r.prompt, r.answer) for r in load_prompts(tmp_path / name)] == [("a", "1")]


def test_a_nan_answer_is_refused(tmp_path):
    path = tmp_path / "nan.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": NaN}\n')
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "finite number" in check_error(e, path, 2)


def test_missing_answer_row(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "missing field 'answer'" in check_error(e, path, 2)


def test_missing_nested_answer_row(tmp_path):
    rows = [DAPO_ROWS[0], DAPO_ROWS[1], {**DAPO_ROWS[0], "reward_model": {"style": "x"}}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "reward_model.ground_truth" in check_error(e, path, 3)


def test_bad_message_and_wrong_types(tmp_path):
    rows = [DAPO_ROWS[0], {**DAPO_ROWS[0], "prompt": [{"role": "user"}]}]
    path = write_jsonl(tmp_path / "msg.jsonl", rows)
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "'content'" in check_error(e, path, 2)

    path = write_jsonl(tmp_path / "types.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": True}])
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "expected a string, a number, or JSON-like lists / dicts" in check_error(e, path, 2)

    # structured answers (a code task's test cases) travel as JSON text
    tests = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    path = write_jsonl(tmp_path / "code.jsonl", [{"prompt": "add", "tests": tests}, {"prompt": "b", "tests": ["x"]}])
    got = load_prompts(path, answer_key="tests")
    assert [json.loads(r.answer) for r in got] == [tests, ["x"]]

    path = write_jsonl(tmp_path / "notobj.jsonl", [{"prompt": "a", "answer": "1"}, ["b", "2"]])
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "expected a JSON object" in check_error(e, path, 2)


def test_undetectable_and_explicit_missing_key(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", [{"text": "a", "label": "1"}])
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "no prompt field" in check_error(e, path, 1)
    with pytest.raises(DatasetError) as e:
        load_prompts(path, prompt_key="text", answer_key="gold")
    assert "missing field 'gold'" in check_error(e, path, 1)


def test_empty_and_unknown_extension(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_prompts(path)
    path = tmp_path / "data.csv"
    path.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="extension") as e:
        load_prompts(path)
    assert "data.format" in str(e.value) and "format='" not in str(e.value)


def test_parquet_errors(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet support needs the 'pyarrow' package")
    import pyarrow.parquet as pq

    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "Parquet" in check_error(e, path, None)

    path = tmp_path / "null.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]), path)
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    check_error(e, path, 2)


# ------------------------------------------------------------------------------------------ rendering

@pytest.fixture(scope="module")
def chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|system|>", "<|assistant|>"]
    words = specials + ["what", "is", "1", "+", "2", "?", "be", "terse", "half", "of"]
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(specials)
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", chat_template=template)
    return tok


def test_render_with_chat_template(chat_tokenizer):
    tok = chat_tokenizer
    v = tok.get_vocab()
    rec = PromptRecord(prompt=[{"role": "system", "content": "be terse"}, {"role": "user", "content": "what is 1 + 2 ?"}],
                       answer="3")
    ids = render_prompt(rec, tok)
    expect = [v[w] for w in ["<bos>", "<|system|>", "be", "terse", "<|user|>", "what", "is", "1", "+", "2", "?",
                             "<|assistant|>"]]
    assert ids == expect
    # a string prompt becomes one user message
    assert render_prompt(PromptRecord("what is 1 + 2 ?", "3"), tok) == [v["<bos>"]] + expect[4:]
    # chat_template=False: plain encode of the text
    assert render_prompt(PromptRecord("what is 1 + 2 ?", "3"), tok, chat_template=False) == tok.encode("what is 1 + 2 ?")


def test_render_without_template_and_digit_tokenizer(chat_tokenizer):
    tok = DigitTokenizer()
    rec = ReverseDigitsTask(4, seed=3).dataset(1)[0]
    ids = render_prompt(rec, tok)
    assert ids == rec.meta["prompt_ids"] and ids[0] == tok.bos_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(ids[1:-1]) == rec.prompt


# ------------------------------------------------------------------------------------------ loader

def make_records(n):
    return [PromptRecord(prompt=f"p{i}", answer=str(i)) for i in range(n)]


def answers(batch):
    return [int(r.answer) for r in batch]


def test_loader_epochs_are_permutations_and_deterministic():
    recs = make_records(10)
    a = PromptLoader(recs, batch_size=4, seed=7)
    seq = [i for _ in range(5) for i in answers(a.next_batch())]  # 20 prompts = exactly 2 epochs
    assert sorted(seq[:10]) == list(range(10)) and sorted(seq[10:]) == list(range(10))
    assert seq[:10] != seq[10:]  # reshuffled per epoch
    b = PromptLoader(recs, batch_size=4, seed=7)
    assert [i for _ in range(5) for i in answers(b.next_batch())] == seq
    c = PromptLoader(recs, batch_size=4, seed=8)
    assert [i for _ in range(5) for i in answers(c.next_batch())] != seq
    assert a.state_dict() == {"seed": 7, "epoch": 2, "index": 0, "num_records": 10, "records": a.fingerprint}
    # epoch e's order is the documented one
    assert seq[:10] == np.random.default_rng([7, 0]).permutation(10).tolist()


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])
def test_loader_resume_matches_uninterrupted_run(stop_after):
    recs = make_records(7)  # 7 prompts, batches of 3: batches straddle epoch boundaries
    full = PromptLoader(recs, batch_size=3, seed=11)
    expected = [answers(full.next_batch()) for _ in range(8)]

    first = PromptLoader(recs, batch_size=3, seed=11)
    got = [answers(first.next_batch()) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint would store
    with pytest.raises(ValueError, match=r"saved with shuffle seed 11 \(data.shuffle_seed\) but this run's is 999"):
        PromptLoader(recs, batch_size=3, seed=999).load_state_dict(state)  # it would not take effect
    resumed = PromptLoader(recs, batch_size=3, seed=11)
    resumed.load_state_dict(state)
    got += [answers(resumed.next_batch()) for _ in range(8 - stop_after)]
    assert got == expected


def test_a_prompt_file_edited_in_place_is_not_continued(tmp_path):
    """The audit's case: every prompt of a JSONL file reversed, the row count kept; the resume trained on the new
    prompts without a word (only the count was checked). The same records from a moved file continue, and a state
    saved before the fingerprint was recorded continues on the count, as it did."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i}{i + 1}", "answer": str(i)}) + "\n" for i in range(6)))
    saved = PromptLoader(load_prompts(path), batch_size=4, seed=0)
    saved.next_batch()
    state = json.loads(json.dumps(saved.state_dict()))
    moved = tmp_path / "moved.jsonl"
    moved.write_text(path.read_text())
    PromptLoader(load_prompts(moved), batch_size=4, seed=0).load_state_dict(state)
    path.write_text("".join(json.dumps({"prompt": f"say {i}{i + 1}"[::-1], "answer": str(i)}) + "\n"
                            for i in range(6)))
    edited = PromptLoader(load_prompts(path), batch_size=4, seed=0)
    with pytest.raises(ValueError, match=f"saved over other prompt records than this dataset's 6 from {path} "
                                         r"\(the same count, other contents: fingerprint [0-9a-f]{16} there"):
        edited.load_state_dict(state)
    edited.load_state_dict({k: v for k, v in state.items() if k != "records"})
    assert edited.index == 4


def test_loader_state_validation():
    loader = PromptLoader(make_records(5), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="5"):
        loader.load_state_dict({"seed": 0, "epoch": 0, "index": 0, "num_records": 6})
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"seed": 0})
    with pytest.raises(ValueError):
        PromptLoader([], batch_size=2, seed=0)


# ---------------------------------------------------------------------------- prompts longer than the width

def digit_file(tmp_path, digits):
    """A plain prompt file of digit strings (DigitTokenizer renders each as <bos> digits <sep>)."""
    return load_prompts(write_jsonl(tmp_path / "digits.jsonl", [{"prompt": d, "answer": d} for d in digits]))


def test_prompts_that_fit_are_kept_with_their_rendered_ids(tmp_path):
    recs, tok = digit_file(tmp_path, ["12", "3456", "7"]), DigitTokenizer()
    kept, ids = fit_prompt_lengths(recs, tok, 6, chat_template=False)
    assert kept == recs and ids == [render_prompt(r, tok, chat_template=False) for r in recs]
    assert [len(x) for x in ids] == [4, 6, 3]


def test_an_overlong_prompt_is_refused_at_load_naming_its_row(tmp_path):
    recs = digit_file(tmp_path, ["12", "34567", "7", "123456789"])
    with pytest.raises(DatasetError) as err:
        fit_prompt_lengths(recs, DigitTokenizer(), 6, chat_template=False)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'digits.jsonl'}, row 2: the prompt renders to 7 tokens, over "
                          "generation.max_prompt_tokens = 6 (2 of 4 prompts are, the longest 11 tokens)"), msg
    assert "data.overlong_prompts: drop" in msg


def test_drop_leaves_overlong_prompts_out_in_order(tmp_path, caplog):
    recs = digit_file(tmp_path, ["12", "34567", "7", "123456789"])
    with caplog.at_level("WARNING", logger="rl.prompt_lengths"):
        kept, ids = fit_prompt_lengths(recs, DigitTokenizer(), 6, chat_template=False, overlong="drop",
                                       limit_key="eval.max_prompt_tokens")
    assert [r.prompt for r in kept] == ["12", "7"] and [len(x) for x in ids] == [4, 3]
    assert "dropped 2 of 4 prompts longer than eval.max_prompt_tokens = 6 tokens" in caplog.text


def test_drop_with_nothing_left_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="every one of the 2 prompts renders to more than generation"):
        fit_prompt_lengths(digit_file(tmp_path, ["12345", "123456"]), DigitTokenizer(), 4, chat_template=False,
                           overlong="drop")


def test_an_id_past_the_model_vocabulary_names_the_tokenizer(tmp_path):
    """A tokenizer that is not the model's renders ids the model does not have: refused at load, by row."""
    recs = digit_file(tmp_path, ["12", "3+4"])  # "+" is id 14 of the DigitTokenizer
    assert len(fit_prompt_lengths(recs, DigitTokenizer(), 8, chat_template=False, vocab_size=16)[0]) == 2
    with pytest.raises(DatasetError, match="row 2: the prompt renders to token id 14, past the model's vocab_size 12; "
                                           "expected the model's own tokenizer"):
        fit_prompt_lengths(recs, DigitTokenizer(), 8, chat_template=False, vocab_size=12)


def test_a_prompt_the_template_or_tokenizer_refuses_names_its_row(tmp_path, chat_tokenizer, caplog):
    """A chat template that refuses a role (jinja2's TemplateError), or text the tokenizer cannot encode (a lone
    surrogate), escaped the load as a bare traceback without file or row."""
    import copy
    tok = copy.copy(chat_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                         "{{ raise_exception('bad role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|> "
                         "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    recs = load_prompts(write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}], "answer": "3"},
        {"prompt": [{"role": "usr", "content": "what is 1 + 2 ?"}], "answer": "3"}]))
    with pytest.raises(DatasetError, match=r"chat.jsonl, row 2: the prompt does not render with the tokenizer's chat "
                                           r"template \(TemplateError: bad role usr\)"):
        fit_prompt_lengths(recs, tok, 64, chat_template=True)
    lone = [PromptRecord("what \ud800 is", "3", meta={"source": "s.jsonl", "row": 7})]
    with pytest.raises(DatasetError, match=r"s.jsonl, row 7: the prompt does not render as text"):
        fit_prompt_lengths(lone, tok, 64, chat_template=False)
    # asked for a template the tokenizer does not have: rendered as text, and now said so
    with caplog.at_level("WARNING", logger="rl.prompt_lengths"):
        fit_prompt_lengths(digit_file(tmp_path, ["12"]), DigitTokenizer(), 8, chat_template=True)
    assert "data.chat_template is true but the tokenizer has no chat template" in caplog.text


def test_the_trainer_checks_every_file_prompt_at_load(tmp_path, monkeypatch, caplog):
    """`rl.prompt_loader.build_data` refuses a prompt file with an overlong prompt before the run builds anything
    else, and with data.overlong_prompts: drop trains on the rest. Fewer prompts than a step takes: a warning (each
    step drew some twice without a word)."""
    import transformers

    from rl.config import load_config
    from rl.prompt_loader import build_data
    from tests.test_run_config import TINY
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: DigitTokenizer())
    (tmp_path / "config.json").write_text(json.dumps(load_config(TINY).model.m3_config().to_hf_dict()))
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": d, "answer": d} for d in ["1234", "1234567", "4321"]])
    args = ["data.kind=file", f"data.path={path}", "model.tiny=null", f"model.path={tmp_path}", "eval.every_steps=0",
            "eval.at_start=false", "grpo.prompts_per_step=2", "grpo.micro_batch_size=16"]
    with pytest.raises(DatasetError, match="row 2: the prompt renders to 9 tokens, over generation.max_prompt_tokens"):
        build_data(load_config(TINY, args))
    with caplog.at_level("WARNING", logger="rl.prompt_loader"):
        _, loader, _ = build_data(load_config(TINY, args + ["data.overlong_prompts=drop"]))
        assert sorted(r.prompt for r in loader.records) == ["1234", "4321"] and "fewer than" not in caplog.text
        build_data(load_config(TINY, args + ["data.overlong_prompts=drop", "grpo.prompts_per_step=4"]))
    assert "holds 2 prompt(s), fewer than grpo.prompts_per_step = 4: every step draws some of them more" in caplog.text


def test_a_prompt_that_renders_to_nothing_is_refused_at_load(tmp_path, chat_tokenizer):
    """A chat row whose message content is "" loaded and then stopped the run at the step that drew it ("prompt 4
    is empty", naming neither file nor row): refused at load, by row."""
    rows = [{"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}], "answer": "3"},
            {"prompt": [{"role": "user", "content": ""}], "answer": "3"}]
    recs = load_prompts(write_jsonl(tmp_path / "chat.jsonl", rows))
    assert render_prompt(recs[1], chat_tokenizer, chat_template=False) == []
    with pytest.raises(DatasetError, match=r"chat.jsonl, row 2: the prompt renders to no tokens"):
        fit_prompt_lengths(recs, chat_tokenizer, 64, chat_template=False)
    assert len(fit_prompt_lengths(recs[:1], chat_tokenizer, 64, chat_template=False)[0]) == 1


def test_chat_prompts_rendered_without_the_template_are_warned_of(tmp_path, chat_tokenizer, caplog):
    """data.chat_template is false by default: chat-message prompts then lose their roles and template, which a
    user of a chat model rarely wants; the load says so once when the tokenizer has a template."""
    rows = [{"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}], "answer": "3"},
            {"prompt": "what is 1 + 2 ?", "answer": "3"}]
    recs = load_prompts(write_jsonl(tmp_path / "chat.jsonl", rows))
    with caplog.at_level("WARNING", logger="rl.prompt_lengths"):
        fit_prompt_lengths(recs, chat_tokenizer, 64, chat_template=True)
        assert not caplog.records
        fit_prompt_lengths(recs, chat_tokenizer, 64, chat_template=False)
    assert "1 of 2 prompts are chat messages and are rendered without the tokenizer's chat template" in caplog.text

"""rl.data: prompt files in the common math-RL layouts, one clear error per bad row, chat rendering. The loader
whose position survives a checkpoint: tests/test_prompt_loader.py. Prompts checked against the width and the
tokenizer at load: tests/test_prompt_lengths.py."""

import json

import pytest

from rl.data import DatasetError, PromptRecord, load_prompts, render_prompt
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


def test_gsm8k_solutions_under_chat_prompts_are_read_as_gsm8k(tmp_path):
    """GSM8K's answer column under chat-message prompts (a helper audit): detected as plain, the whole worked solution
    was the reference, which no boxed answer equals (every sample 0, no failure counted). Its `####` line says it."""
    rows = [{"prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
             "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"prompt": [{"role": "user", "content": "How many?"}], "answer": "Work...\n#### 1,234"}]
    recs = load_prompts(write_jsonl(tmp_path / "chat_gsm8k.jsonl", rows))
    assert [r.answer for r in recs] == ["7", "1234"] and recs[0].meta["layout"] == "gsm8k"
    plain = [{"prompt": "p", "answer": "a #### sign"}, {"prompt": "q", "answer": "12"}]  # no #### line: plain
    assert [r.answer for r in load_prompts(write_jsonl(tmp_path / "plain.jsonl", plain))] == ["a #### sign", "12"]
    # a review: a comment banner or a Markdown heading is not GSM8K's final line (the plain layout as before)
    for text in ("def f(a, b):\n    return a, b\n########## tests ##########\nassert f(1, 2) == (1, 2)",
                 "Solve.\n#### Step 1\nSo $\\boxed{(1, 2)}$"):
        rows = [{"prompt": [{"role": "user", "content": "p"}], "answer": text}]
        assert load_prompts(write_jsonl(tmp_path / "banner.jsonl", rows))[0].answer == text


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


def test_a_json_wrapper_is_one_list_of_objects(tmp_path):
    """{"data": [...]} is unwrapped; a lone record whose one list holds strings was unwrapped into rows of those
    strings ("row 1: expected a JSON object ..., got str 'x'": a helper's audit)."""
    p = tmp_path / "wrapped.json"
    p.write_text(json.dumps({"version": 2, "data": [{"prompt": "a", "answer": "1"}], "tags": ["x"]}))
    assert [r.prompt for r in load_prompts(p)] == ["a"]
    p.write_text(json.dumps({"id": 3, "answer": "1", "tags": ["x"]}))
    with pytest.raises(DatasetError, match=r"a JSON object \(keys id, answer, tags\) that holds no list of "
                                           r"objects; expected a JSON array of objects, or an object with exactly one"
                                           r".* \(one record of JSON Lines\? then set data.format / eval.format"):
        load_prompts(p)
    # a lone record with a prompt field is no wrapper: its chat messages were read as the rows, or the examples it
    # held loaded as the dataset without a word (an audit, 2026-12-08)
    for record in ({"prompt": "a", "answer": "1", "tags": ["x"]},
                   {"prompt": [{"role": "user", "content": "copy 1"}], "answer": "1"},
                   {"Question": "copy 9", "answer": "9", "examples": [{"question": "copy 1", "answer": "1"}]}):
        p.write_text(json.dumps(record))
        with pytest.raises(DatasetError, match=r"one JSON object with a prompt field \('(prompt|Question)'\): a single "
                                               r"record; expected a JSON array of records"):
            load_prompts(p)
    # a wrapper may carry a dataset-level prompt (a system prompt) beside its records, and no answer
    p.write_text(json.dumps({"prompt": "You are a careful solver.", "data": [{"question": "1+1?", "answer": "2"}]}))
    assert [r.prompt for r in load_prompts(p)] == ["1+1?"]


def test_json_lines_in_a_json_file_says_to_set_the_format(tmp_path):
    """datasets' Dataset.to_json("x.json") writes JSON Lines: an audit found the error naming only "Extra data"."""
    p = tmp_path / "train.json"
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"Extra data at line 2, column 1\) \(one JSON object a line, .*set "
                                           r"data.format / eval.format: jsonl\)"):
        load_prompts(p)
    assert [r.prompt for r in load_prompts(p, format="jsonl")] == ["a", "b"]


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

    # chat messages with nothing in them (a chat template would render its roles around nothing), as "" is refused
    path = write_jsonl(tmp_path / "blank.jsonl", [DAPO_ROWS[0], {**DAPO_ROWS[0], "prompt": [
        {"role": "system", "content": " "}, {"role": "user", "content": ""}]}])
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    assert "every message's content is empty" in check_error(e, path, 2)

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
    # the config's keys, which a command-line user sets (it named the Python keyword alone)
    assert "set data.prompt_key / eval.prompt_key (prompt_key= in Python)" in str(e.value)
    with pytest.raises(DatasetError, match=r"no answer field.*set data.answer_key / eval.answer_key"):
        load_prompts(path, prompt_key="text")
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


def test_messages_without_a_template_are_joined_by_blank_lines():
    """As render_prompt's docstring says (a mutation audit: a single newline passed every test)."""
    class Chars:
        bos_token = chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    rec = PromptRecord(prompt=[{"role": "system", "content": "A"}, {"role": "user", "content": "B"}], answer="")
    assert render_prompt(rec, Chars()) == [ord(c) for c in "A\n\nB"]


@pytest.mark.parametrize("name", ["big.jsonl", "big.json"])
def test_a_file_that_is_not_utf8_names_its_line(tmp_path, name):
    """An audit: the error named the byte within the text reader's ~8 KiB chunk (4750 for byte 144014) and no row."""
    lines = [b'{"prompt": "question number %05d", "answer": "1"}\n' % i for i in range(5000)]
    lines[3000] = b'{"prompt": "caf\xe9", "answer": "1"}\n'
    path = tmp_path / name
    path.write_bytes(b"".join(lines) if name.endswith("l") else b"[" + b",".join(lines) + b"]")
    with pytest.raises(DatasetError) as e:
        load_prompts(path)
    where = f"{path}, row 3001: not UTF-8 text (invalid continuation byte at byte 16 of the line)" if name.endswith(
        "l") else f"{path}: not UTF-8 text (invalid continuation byte at byte 17 of line 3001)"  # after its comma
    assert str(e.value).startswith(where), str(e.value)

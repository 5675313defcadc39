"""rl.prompt_lengths: every prompt of a file rendered once at load, and refused by row (or dropped) where it cannot
be generated from: longer than the width, past the model's vocabulary, empty, or refused by the chat template or the
tokenizer. The file formats and the loader: tests/test_data.py."""

import json

import pytest

from rl.data import DatasetError, PromptRecord, load_prompts, render_prompt
from rl.prompt_lengths import fit_prompt_lengths
from rl.tasks import DigitTokenizer
from tests.test_data import write_jsonl


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


def test_a_chat_template_that_is_not_jinja_is_the_tokenizers_error_not_the_rows(tmp_path, chat_tokenizer):
    """A syntax error in the template fails every row alike: it named the prompt file's first row as the fault."""
    import copy

    from m3jax import CheckpointError
    tok = copy.copy(chat_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }"
    recs = load_prompts(write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}], "answer": "3"}]))
    with pytest.raises(CheckpointError, match=r"its chat template is not valid Jinja \(unexpected '}', line 1 of the "
                                              r"template\).*or data.chat_template=false"):
        fit_prompt_lengths(recs, tok, 64, chat_template=True)


def test_a_row_that_does_not_render_is_named_without_jinja2(monkeypatch):
    """The template check looks at jinja2 only where it was imported: a render failure where it is not installed
    raised ModuleNotFoundError instead of the row's DatasetError (a review)."""
    import sys

    class Unencodable:
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            raise ValueError("cannot encode")
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(DatasetError, match=r"x.jsonl, row 1: the prompt does not render as text"):
        fit_prompt_lengths([PromptRecord("hello", "1", meta={"row": 1, "source": "x.jsonl"})], Unencodable(), 64,
                           chat_template=False)


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
    import dataclasses
    rows = [{"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}], "answer": "3"},
            {"prompt": [{"role": "user", "content": ""}], "answer": "3"}]
    with pytest.raises(DatasetError, match=r"chat.jsonl, row 2: field 'prompt': every message's content is empty"):
        load_prompts(write_jsonl(tmp_path / "chat.jsonl", rows))  # the reader refuses it now (session 51)
    # the check at load stays for records made otherwise (a task's, a reader's own)
    first = load_prompts(write_jsonl(tmp_path / "chat.jsonl", rows[:1]))[0]
    recs = [first, dataclasses.replace(first, prompt=rows[1]["prompt"], meta={**first.meta, "row": 2})]
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


@pytest.fixture
def llama_like():
    """A tokenizer whose encode adds its BOS and whose chat template writes it, as Llama-3's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<unk>": 1, "<|begin_of_text|>": 2, "<|start_header_id|>": 3, "<|end_header_id|>": 4,
             "<|eot_id|>": 5, "user": 6, "assistant": 7, "what": 8, "is": 9, "1": 10}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                      special_tokens=[("<|begin_of_text|>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|> {{ m['role'] }} "
                         "<|end_header_id|> {{ m['content'] }} <|eot_id|> {% endfor %}"
                         "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|>{% endif %}")
    return tok


def test_a_prompt_rendered_already_gets_one_bos_and_a_warning(llama_like, caplog):
    """Exported datasets often store prompts a chat template rendered: encoded plainly each gained a second BOS,
    through the template again the whole conversation became one user message; nothing was said (an audit)."""
    rendered = llama_like.apply_chat_template([{"role": "user", "content": "what is 1"}], add_generation_prompt=True,
                                              tokenize=False)
    plain = [PromptRecord("what is 1", "1", meta={"source": "p.jsonl", "row": 1})]
    done = [PromptRecord(rendered, "1", meta={"source": "p.jsonl", "row": 2})]
    assert render_prompt(plain[0], llama_like, chat_template=False)[:2] == [2, 8]  # its BOS, added once
    with caplog.at_level("WARNING", logger="rl.prompt_lengths"):
        _, ids = fit_prompt_lengths(plain, llama_like, 64, chat_template=False)
    assert caplog.text == "" and ids[0][:2] == [2, 8]
    with caplog.at_level("WARNING", logger="rl.prompt_lengths"):
        _, ids = fit_prompt_lengths(done, llama_like, 64, chat_template=False)
    chat = PromptRecord([{"role": "user", "content": "what is 1"}], "1")
    assert ids[0] == render_prompt(chat, llama_like, chat_template=True) and ids[0].count(2) == 1  # one BOS
    assert "1 of 1 string prompts already hold the tokenizer's special tokens" in caplog.text
    assert "p.jsonl row 2" in caplog.text and "not doubled" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rl.prompt_lengths"):
        fit_prompt_lengths(done, llama_like, 64, chat_template=True)
    assert "set data.chat_template=false to read them as they are" in caplog.text


def test_every_draw_generates_from_the_ids_rendered_at_load(tmp_path, monkeypatch, chat_tokenizer):
    """A chat template that writes today's date (Llama 3.2's strftime_now) rendered other ids at each step than the
    ones checked at load, and hosts drawing either side of midnight generated from different prompts (an audit).
    The ids rendered at load are the records' own (`PromptRecord.ids`), and every draw reuses them."""
    import copy

    import transformers

    from rl import phases
    from rl.config import load_config
    from rl.prompt_loader import build_data
    from tests.test_run_config import TINY
    tok = copy.copy(chat_tokenizer)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: tok)
    (tmp_path / "config.json").write_text(json.dumps(load_config(TINY).model.m3_config().to_hf_dict()))
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "what is 1 + 2 ?", "answer": "3"}] * 2)
    cfg = load_config(TINY, ["data.kind=file", f"data.path={path}", "model.tiny=null", f"model.path={tmp_path}",
                             "eval.every_steps=0", "eval.at_start=false", "grpo.prompts_per_step=2",
                             "grpo.micro_batch_size=16", "data.chat_template=true",
                             "generation.max_prompt_tokens=16"], check_paths=False)
    tokenizer, loader, _ = build_data(cfg)
    at_load = render_prompt(loader.records[0], tokenizer, chat_template=True)
    assert [list(r.ids) for r in loader.records] == [at_load] * 2
    tokenizer.chat_template = "{{ 'half of ' }}" + tokenizer.chat_template  # the next day's rendering

    class Drawn(Exception):
        pass

    class Engine:
        def generate(self, rows, sampling, key, prompt_width=None):
            raise Drawn(rows)

    with pytest.raises(Drawn) as drawn:
        phases.rollout(Engine(), loader.next_batch(), tokenizer, cfg, None, step=0)
    assert drawn.value.args[0] == [at_load] * (2 * cfg.grpo.group_size)
    assert render_prompt(loader.records[0], tokenizer, chat_template=True) != at_load

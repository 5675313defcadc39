"""model.path's tokenizer: a directory without tokenizer files, or with a broken tokenizer.json, is one
CheckpointError naming the directory or file (it was a transformers ValueError / bare JSONDecodeError traceback
from build_data)."""

import json

import pytest

from m3jax import CheckpointError
from rl.model_tokenizer import load_tokenizer


@pytest.fixture
def saved(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<unk>": 1, "what": 2, "is": 3}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>").save_pretrained(tmp_path)
    return tmp_path


def test_a_saved_tokenizer_loads(saved):
    assert load_tokenizer(str(saved)).encode("what is 1") == [2, 3, 1]


def test_a_directory_without_tokenizer_files(saved):
    for f in saved.iterdir():
        f.unlink()
    (saved / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"no tokenizer in {saved}: expected tokenizer.json"):
        load_tokenizer(str(saved))


def test_a_broken_tokenizer_json(saved):
    (saved / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match=f"{saved / 'tokenizer.json'} is not valid JSON"):
        load_tokenizer(str(saved))


def test_build_data_refuses_a_model_dir_without_a_tokenizer(tmp_path):
    from rl.config import load_config
    from rl.prompt_loader import build_data
    from tests.test_run_config import TINY
    (tmp_path / "config.json").write_text(json.dumps(load_config(TINY).model.m3_config().to_hf_dict()))
    (tmp_path / "train.jsonl").write_text('{"prompt": "1", "answer": "1"}\n')
    args = ["data.kind=file", f"data.path={tmp_path / 'train.jsonl'}", "model.tiny=null", f"model.path={tmp_path}",
            "eval.every_steps=0", "eval.at_start=false", "grpo.prompts_per_step=2", "grpo.micro_batch_size=16"]
    with pytest.raises(CheckpointError, match=f"no tokenizer in {tmp_path}"):
        build_data(load_config(TINY, args))

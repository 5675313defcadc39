"""What checking a prompt file's lengths at load costs: `rl.prompt_lengths.fit_prompt_lengths` over N chat prompts.

The trainer renders every prompt of a file once at load (`data.overlong_prompts`) to refuse or drop the ones
longer than `generation.max_prompt_tokens`. No model's tokenizer can be downloaded here, so this builds one
locally: a byte-level BPE (`tokenizers`, 32k merges trained on the generated text) in a
`PreTrainedTokenizerFast` with a ChatML chat template (the form of Qwen's and of M3's). The prompts are
DAPO-math-like: an instruction plus a problem of --words words. Prints the tokenizer's build time apart, then
the total and per-prompt time of `fit_prompt_lengths(..., chat_template=True)` and the prompts' token lengths.

    .venv/bin/python scripts/bench_prompt_render.py                   # 17,000 prompts (DAPO-math-17k's size)
    .venv/bin/python scripts/bench_prompt_render.py --prompts 100000 --words 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from rl.data import PromptRecord  # noqa: E402
from rl.prompt_lengths import fit_prompt_lengths  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("let find the number of real solutions integer x y z prime triangle area circle radius sum product "
         "probability chosen random sequence define function value smallest largest positive divisible by "
         "remainder when divided polynomial roots coefficient equal square cube digits base").split()


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = WORDS + [str(i) for i in range(100)] + ["+", "-", "=", "^", "(", ")", "$", "\\frac"]
    return ["Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer where $Answer is the answer to the problem.\n\n"
            + " ".join(rng.choice(vocab, words)) for _ in range(n)]


def tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(vocab_size=32000, special_tokens=special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=17000)
    ap.add_argument("--words", type=int, default=120)
    ap.add_argument("--limit", type=int, default=2048, help="generation.max_prompt_tokens")
    args = ap.parse_args()
    texts = prompts(args.prompts, args.words)
    t = time.perf_counter()
    tok = tokenizer(texts)
    build_s = time.perf_counter() - t
    records = [PromptRecord([{"role": "user", "content": x}], "0", {"row": i + 1}) for i, x in enumerate(texts)]
    t = time.perf_counter()
    kept, ids = fit_prompt_lengths(records, tok, args.limit, chat_template=True)
    check_s = time.perf_counter() - t
    lengths = np.array([len(x) for x in ids])
    print(f"tokenizer built in {build_s:.1f} s (vocab {len(tok)}); {args.prompts} prompts of {args.words} words, "
          f"{lengths.min()}-{lengths.max()} tokens (median {int(np.median(lengths))}), {len(kept)} within {args.limit}")
    print(f"fit_prompt_lengths (chat template): {check_s:.2f} s, {check_s / args.prompts * 1e6:.0f} us per prompt")


if __name__ == "__main__":
    main()

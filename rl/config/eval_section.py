"""The `eval` section of a run config: held-out evaluation (`rl.evaluate`, `python -m m3jax.eval`).

Declared like the sections of `rl.config.schema` (`_f`); its cross-field rules are in
`rl.config.validate_eval`.
"""

from __future__ import annotations

import dataclasses

from rl.config.schema import DATA_FORMATS, DATA_LAYOUTS, DATA_TASKS, MAX_SEED, RewardSpec, _f, _Section


EVAL_METRICS = ("pass@1", "pass@k", "maj@k", "reward_mean")   # rl.evaluate.METRICS (without the val/ prefix)


@dataclasses.dataclass(frozen=True)
class EvalSection(_Section):
    """Held-out evaluation (`rl.evaluate`): k samples per prompt from the run's generator, scored by the
    rewards; logged as val/* (val/pass@1, val/pass@k, val/reward_mean, val/response_length_mean)."""

    every_steps: int = _f(0, "evaluate every this many steps and after the last step (0 = never during "
                             "training; python -m m3jax.eval still reads this section)", min=0)
    at_start: bool = _f(False, "also evaluate the initial policy, logged as step 0 (a resumed run does not)")
    kind: str = _f("synthetic", "synthetic: prompts of a digit task that are not among the run's training "
                                "records (rl.tasks.DigitTask.held_out); file: prompts from path",
                   choices=("synthetic", "file"))
    task: str | None = _f(None, "synthetic task; null = data.task", choices=DATA_TASKS)
    num_digits: int | None = _f(None, "digits per synthetic prompt; null = data.num_digits", min=1)
    path: str | None = _f(None, "prompt file for kind=file (same formats and layouts as data.path)",
                          allowed="a .jsonl, .json or .parquet file, or null when eval.kind is synthetic")
    format: str = _f("auto", "file format; auto = from the extension", choices=DATA_FORMATS)
    layout: str = _f("auto", "record layout (rl.data): auto-detected, dapo, gsm8k or plain", choices=DATA_LAYOUTS)
    prompt_key: str | None = _f(None, "record field holding the prompt; null = from the layout")
    answer_key: str | None = _f(None, "record field holding the reference answer; null = from the layout")
    seed: int = _f(0, "seed of the synthetic prompts, of the subset taken from a larger file and of the "
                      "sampling (the same at every evaluation)", min=0, max=MAX_SEED)
    max_prompts: int | None = _f(64, "prompts evaluated (a seeded subset of a larger file); null = all of the "
                                     "file", min=1)
    samples_per_prompt: int = _f(1, "samples per prompt: n of the pass@k estimator and the k of val/pass@k", min=1)
    pass_k: tuple[int, ...] = _f([], "further k of the unbiased pass@k, each logged as val/pass@<k> (a pass@k "
                                     "curve: e.g. [2, 4, 8] with 16 samples); each in [1, samples_per_prompt]",
                                 items={"min": 1}, distinct=True)
    majority_answer: str = _f("none", "also log val/maj@k (k = samples_per_prompt): a prompt counts when its most "
                                      "frequent answer is correct; the answer is the last \\boxed{} or 'Answer:' "
                                      "line (boxed: math), or the whole response stripped (response); none = off",
                              choices=("none", "boxed", "response"))
    # the engines draw a batch's samples from one key, so a row's draw depends on the batch it shares (an audit):
    # said here, where a user lowers it to fit `python -m m3jax.eval` on fewer devices
    prompts_per_batch: int | None = _f(None, "prompts per generate call (bounds the JAX engine's batch); "
                                             "null = all at once. Part of the sampled draw: another value samples "
                                             "other responses (at temperature > 0), so evaluate a run's checkpoint "
                                             "with the run's value to get what it logged", min=1)
    temperature: float = _f(0.0, "sampling temperature; 0 = greedy (with samples_per_prompt 1)", min=0)
    top_p: float = _f(1.0, "nucleus sampling mass (1 = off)", gt=0, max=1)
    max_new_tokens: int | None = _f(None, "response length limit; null = generation.max_new_tokens", min=1)
    max_prompt_tokens: int | None = _f(None, "prompt length limit (pad width); null = "
                                             "generation.max_prompt_tokens", min=1)
    reward: tuple[RewardSpec, ...] = _f([], "rewards summed into a sample's score; empty = the run's reward")
    correct_threshold: float = _f(1.0, "a sample is correct when its score is >= this (the digit rewards give "
                                       "partial credit: 1.0 = every digit right); refused at load where the "
                                       "rewards' ranges make it unreachable, or reached by every sample")
    best_metric: str = _f("pass@1", "held-out metric whose best value (higher is better) checkpoints remember",
                          choices=EVAL_METRICS)

    @property
    def enabled(self) -> bool:
        """Whether training evaluates at all."""
        return self.every_steps > 0 or self.at_start

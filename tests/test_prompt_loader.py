"""rl.prompt_loader.PromptLoader: seeded epochs, a resume that draws as the uninterrupted run did (also under
another prompts_per_step), and a checkpoint's position refused over other records (moved from tests/test_data.py)."""

import json

import numpy as np
import pytest

from rl.data import PromptRecord, load_prompts
from rl.prompt_loader import PromptLoader


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
    assert a.state_dict() == {"seed": 7, "epoch": 2, "index": 0, "num_records": 10, "head": [], "head_batch": 4,
                              "records": a.fingerprint}  # epoch 2 began with a batch: no head
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


@pytest.mark.parametrize("n, batch", [(10, 4), (30, 16), (7, 3), (100, 32), (9, 9), (4, 3)])  # (4, 3): a mutation audit
def test_a_batch_across_an_epoch_boundary_holds_distinct_prompts(n, batch):
    """An audit found the end of one epoch's order and the start of the next's in one batch holding a prompt twice
    (82 of 200 steps with 30 prompts, 16 a step; its groups weighed double in the step's loss). Every batch is now
    distinct, every epoch still draws each prompt once, and a resume at any step continues the same batches."""
    loader = PromptLoader(make_records(n), batch_size=batch, seed=3)
    batches = [answers(loader.next_batch()) for _ in range(60)]
    assert all(len(set(b)) == len(b) for b in batches)
    flat = [i for b in batches for i in b]
    for e in range(len(flat) // n):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n)), e
    states = []
    replay = PromptLoader(make_records(n), batch_size=batch, seed=3)
    for _ in range(60):
        states.append(json.loads(json.dumps(replay.state_dict())))
        replay.next_batch()
    for step in (1, 7, 23, 59):
        for state in (states[step], {k: v for k, v in states[step].items() if not k.startswith("head")}):
            resumed = PromptLoader(make_records(n), batch_size=batch, seed=3)
            resumed.load_state_dict(state)  # also a state saved before the head was recorded
            assert [answers(resumed.next_batch()) for _ in range(60 - step)] == batches[step:], step


@pytest.mark.parametrize("n, before, after", [(10, 2, 3), (13, 4, 3), (30, 7, 16), (7, 3, 9)])
def test_a_resume_with_another_prompts_per_step_draws_each_prompt_once_an_epoch(n, before, after):
    """An audit: a resume with another grpo.prompts_per_step (a setting that may change on a resume) rebuilt the
    epoch under way with the new batch size, another order than the one it was partway through: prompts 10, batches
    2 then 3, epoch 1 drew prompt 1 twice and prompt 3 never."""
    for stop in range(1, 3 * n // before):
        first = PromptLoader(make_records(n), batch_size=before, seed=0)
        drawn = [i for _ in range(stop) for i in answers(first.next_batch())]
        resumed = PromptLoader(make_records(n), batch_size=after, seed=0)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        drawn += [i for _ in range(3 * n // after + 1) for i in answers(resumed.next_batch())]
        for e in range(3):
            assert sorted(drawn[e * n:(e + 1) * n]) == list(range(n)), (stop, e, drawn)


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


def test_the_same_prompts_with_other_answers_are_not_continued():
    """The rewards score against the answers: records whose answers changed are other records (a mutation audit: the
    fingerprint without the answer passed every test, a JSONL row's meta holding its answer again)."""
    saved = PromptLoader(make_records(6), batch_size=4, seed=0)
    saved.next_batch()
    other = [PromptRecord(prompt=r.prompt, answer=r.answer + "0") for r in make_records(6)]
    with pytest.raises(ValueError, match="saved over other prompt records"):
        PromptLoader(other, batch_size=4, seed=0).load_state_dict(saved.state_dict())


def test_loader_state_validation():
    loader = PromptLoader(make_records(5), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="5"):
        loader.load_state_dict({"seed": 0, "epoch": 0, "index": 0, "num_records": 6})
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"seed": 0})
    with pytest.raises(ValueError, match=r"head \[7\] / head_batch 2 is not a list of record indices below 5"):
        loader.load_state_dict({"seed": 0, "epoch": 1, "index": 0, "head": [7], "head_batch": 2})
    with pytest.raises(ValueError):
        PromptLoader([], batch_size=2, seed=0)

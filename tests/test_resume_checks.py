"""A resume is compared with the config its checkpoint was trained under (`rl.resume_checks`).

Found by an audit of resume: a model setting that keeps every shape (num_experts_per_tok, rope_theta) or the Adam
moments' dtype changed on a resume trained on with only a warning, which showed model.tiny's defaults as None; and
the warning compared with config.yaml, which every start rewrites, so a second start with the same change (after
one that saved nothing) warned of nothing and trained on under it.
"""

import functools
import logging

import pytest

from rl.checkpoint import CheckpointMismatch
from rl.config import load_config
from rl.resume_checks import changes_warning, check, trained_under
from tests.tiny_runs import TINY, tiny_trainer


def under(*overrides):
    return trained_under(load_config(str(TINY), list(overrides)))


def test_a_model_or_moment_change_that_keeps_the_shapes_is_refused_by_name():
    meta = {"step": 3, **under()}
    with pytest.raises(CheckpointMismatch) as e:
        check(meta, under("model.tiny.num_experts_per_tok=1", "model.tiny.rope_theta=10000",
                          "precision.moment_dtype=bfloat16", "optim.lr=3e-4"), "checkpoint step 3 in d")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("checkpoint step 3 in d was trained as another model or optimizer "
                                              "state than this run's config asks for: ")
    # the model's own default (rope_theta is not in configs/tiny.yaml), not None
    for said in ("model.tiny.num_experts_per_tok 2 there, 1 here", "model.tiny.rope_theta 5000000.0 there, 10000 here",
                 "precision.moment_dtype 'float32' there, 'bfloat16' here"):
        assert said in msg, msg
    assert "optim.lr" not in msg  # a setting the state does not fix only warns


def test_what_does_not_change_the_model_warns_against_the_checkpoint():
    meta = under()
    # the token ids and the position bound leave the weights' function alone; a default restated changes nothing
    assert check(meta, under("model.tiny.max_position_embeddings=128", "model.tiny.rope_theta=5000000.0"), "c") == []
    changed = check(meta, under("run.seed=7", "optim.lr=3e-4", "grpo.group_size=4",
                            "grpo.micro_batch_size=128"), "c")
    assert changed == [("run.seed", 0, 7), ("optim.lr", 1e-3, 3e-4), ("grpo.group_size", 8, 4),
                       ("grpo.micro_batch_size", 256, 128)]
    assert changes_warning(6, changed, []) == (
        "resumed from step 6 with settings changed since that checkpoint was saved, which apply from step 7 on: "
        "run.seed 0 -> 7; optim.lr 0.001 -> 0.0003; grpo.group_size 8 -> 4; grpo.micro_batch_size 256 -> 128")
    # a checkpoint saved before the config was recorded: config.yaml's differences, as before
    assert check({"step": 6, "data": {}}, under(), "c") is None
    assert changes_warning(6, None, [("optim.lr", 1e-3, 3e-4)]).startswith(
        "resumed from step 6 with settings changed since config.yaml was last written, which apply from step 7 on: "
        "optim.lr 0.001 -> 0.0003")
    assert changes_warning(0, changed, changed) is None and changes_warning(6, [], [("a", 1, 2)]) is None


@pytest.mark.slow
def test_each_resume_names_every_change_since_its_checkpoint(tmp_path, caplog):
    """Repro of the audit on the tiny trainer: a refused start changes nothing (config.yaml included); a start that
    changes settings and saves nothing ("nothing to train") rewrites config.yaml, and the next start still names
    those changes."""
    caplog.set_level(logging.WARNING, logger="rl.trainer")
    trainer = functools.partial(tiny_trainer, tmp_path, "run", "eval.every_steps=0", "eval.at_start=false",
                                "logging.plot=false", "logging.progress_bar=false", "logging.indexer_recall_every=0",
                                "checkpoint.export_hf_at_end=false")
    trainer("run.total_steps=1").run()
    config_yaml = (tmp_path / "run" / "config.yaml").read_text()

    def refused(match, *overrides):
        with pytest.raises(CheckpointMismatch, match=match):
            run = trainer("run.total_steps=2", *overrides)  # a state of other stages is refused as it is restored
            try:
                run.run()
            finally:
                run.engine.shutdown()
        assert (tmp_path / "run" / "config.yaml").read_text() == config_yaml

    refused(r"model.tiny.num_experts_per_tok 2 there, 1 here; precision.moment_dtype 'float32' there, 'bfloat16' here",
            "model.tiny.num_experts_per_tok=1", "precision.moment_dtype=bfloat16")
    # an optimizer stage switched on: the restore's "holds another state" now names the setting (an audit)
    refused(r"optim.weight_decay \(on or off: the optimizer state holds its stage or not\) 0.0 there, 0.01 here",
            "optim.weight_decay=0.01")
    # the checkpoint's loader order stands: another shuffle seed would be recorded in config.yaml, not used
    # (and the settings changed since the checkpoint that decide the prompts are named: an audit)
    refused(r"cannot continue this run's prompts \(loader state was saved with shuffle seed 0 \(data.shuffle_seed\) "
            r"but this run's is 3.*; changed since the checkpoint: data.shuffle_seed$", "data.shuffle_seed=3")

    trainer("run.total_steps=1", "run.seed=7", "optim.lr=3e-4").run()  # nothing to train; config.yaml rewritten
    caplog.clear()
    resumed = trainer("run.total_steps=2", "run.seed=7", "optim.lr=3e-4")
    resumed.run()
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from step 1")]
    assert warned == ["resumed from step 1 with settings changed since that checkpoint was saved, which apply from "
                      "step 2 on: run.seed 0 -> 7; run.total_steps 1 -> 2; optim.lr 0.001 -> 0.0003"], warned
    assert resumed.checkpointer.steps()[-1] == 2


def test_updates_per_step_changed_under_a_counting_schedule_is_refused():
    """Found by an audit of option interactions: the schedule reads the restored update count // updates_per_step,
    so a resume from step 2 (2 updates) with 2 updates per step trained step 3 at step 2's warm-up rate, and every
    later step one behind, with only a warning."""
    meta = under("optim.warmup_steps=4")
    with pytest.raises(CheckpointMismatch, match=r"grpo.updates_per_step \(the learning-rate schedule counts its "
                                                 r"updates\) 1 there, 2 here"):
        check(meta, under("optim.warmup_steps=4", "grpo.updates_per_step=2", "grpo.micro_batch_size=128"), "c")
    with pytest.raises(CheckpointMismatch, match="grpo.updates_per_step"):
        check(under(), under("optim.schedule=cosine", "grpo.updates_per_step=2", "grpo.micro_batch_size=128"), "c")
    # a flat schedule reads no count: the change applies from the next step, with the warning
    assert sorted(check(under(), under("grpo.updates_per_step=2", "grpo.micro_batch_size=128"), "c")) == [
        ("grpo.micro_batch_size", 256, 128), ("grpo.updates_per_step", 1, 2)]


def test_an_optimizer_stage_switched_on_or_off_is_refused_by_name():
    """optim.weight_decay 0 -> 0.01 or clip_norm on -> off adds or removes a stage of the optimizer state, and the
    restore refused it as "another state" naming no setting; a value changed within a stage only warns."""
    stage = r"\(on or off: the optimizer state holds its stage or not\)"
    with pytest.raises(CheckpointMismatch, match=rf"optim.weight_decay {stage} 0.0 there, 0.01 here; "
                                                 rf"optim.clip_norm {stage} 1.0 there, None here"):
        check(under(), under("optim.weight_decay=0.01", "optim.clip_norm=null"), "c")
    assert check(under("optim.weight_decay=0.01"), under("optim.weight_decay=0.02", "optim.clip_norm=2.0"), "c") == [
        ("optim.weight_decay", 0.01, 0.02), ("optim.clip_norm", 1.0, 2.0)]


@pytest.mark.parametrize("trained, read, warned", [("fp32", "none", True), ("none", "compact", True),
                                                   ("fp32", "compact", False), ("fp32", "fp32", False)])
def test_an_export_or_evaluation_in_another_precision_says_it_reads_other_weights(caplog, trained, read, warned):
    """A bf16 run exported with precision.master=none wrote its fp32 master, not the bf16 policy it trained and
    evaluated (logits 3e-3 apart), silently (an audit). fp32 and compact hold the same weights: nothing said."""
    from rl.resume_checks import check_model
    meta = {"step": 4, "config": under(f"precision.master={trained}")["config"]}
    with caplog.at_level(logging.WARNING):
        check_model(meta, load_config(str(TINY), [f"precision.master={read}"]), "checkpoint step 4 in d", "export")
    said = [r.getMessage() for r in caplog.records if "precision.master" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert said[0].startswith(f"checkpoint step 4 in d was trained with precision.master {trained!r}")
        assert f"precision.master={trained} reads those" in said[0]


def test_a_model_field_added_after_the_checkpoint_compares_as_its_default():
    """A checkpoint saved by a version whose M3Config lacked a field was compared as None there: every resume across
    the upgrade was refused ("index_local_blocks None there, 1 here"). The version before the field built the model
    the field's default describes; a value other than it is still refused, naming the default."""
    meta = {"step": 3, **under()}
    del meta["model"]["index_local_blocks"], meta["model"]["swiglu_limit"]
    assert check(meta, under(), "c") == []
    with pytest.raises(CheckpointMismatch) as e:
        check(meta, under("model.tiny.index_local_blocks=2"), "checkpoint step 3 in d")
    assert "model.tiny.index_local_blocks 1 there, 2 here" in str(e.value), str(e.value)
    assert "swiglu_limit" not in str(e.value)
    from rl.resume_checks import check_model
    check_model(meta, load_config(str(TINY)), "checkpoint step 3 in d", "export")  # the same rule for an export


def test_a_setting_added_after_the_checkpoint_is_not_a_change_at_its_default():
    """A helper's upgrade audit: a checkpoint of an older version resumed with nothing changed warned of
    'logging.moe_drops_every None -> 0; checkpoint.keep_best None -> 0': settings that did not exist then, which
    that version ran as their defaults describe. Set otherwise, they are changes from the default."""
    meta = {"step": 3, **under()}
    del meta["config"]["logging"]["moe_drops_every"], meta["config"]["checkpoint"]["keep_best"]
    del meta["config"]["precision"]["moment_dtype"]  # compared as its default, not refused as None
    assert check(meta, under(), "c") == []
    assert check(meta, under("logging.moe_drops_every=5"), "c") == [("logging.moe_drops_every", 0, 5)]
    with pytest.raises(CheckpointMismatch, match="precision.moment_dtype 'float32' there, 'bfloat16' here"):
        check(meta, under("precision.moment_dtype=bfloat16"), "c")

"""Bad input to the user commands found by an audit (session 47): each is now one error line, before anything is
written, where it was a traceback, a half-written output, or a command that quietly did something else."""

import json
import os
import shutil

import pytest

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tiny.yaml")


@pytest.mark.parametrize("command, argv, flag", [
    ("m3jax.train", ["--config", TINY, "--export", ""], "--export"),  # trained the run (or resumed it), status 0
    ("m3jax.eval", ["--config", TINY, "--hf", " "], "--hf"),  # scored the run's own checkpoint instead
    ("m3jax.convert", ["src", "dst", "--carry-from", ""], "--carry-from"),  # carried from src
    ("m3jax.plot", ["run", "--out", ""], "--out"),  # wrote a hidden .png.png and printed ".png"
    ("m3jax.demo", ["--out", ""], "--out"),
])
def test_an_empty_path_argument_is_refused_by_name(command, argv, flag, capsys, tmp_path, monkeypatch):
    import importlib
    monkeypatch.chdir(tmp_path)  # nothing may be written: any output would land here
    with pytest.raises(SystemExit) as e:
        importlib.import_module(command).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: " in err and "an empty path; expected a file or directory" in err
    assert os.listdir(tmp_path) == []


def test_the_plot_command_checks_the_image_format_and_prints_the_file_it_writes(tmp_path, capsys, caplog):
    from m3jax.plot import main
    run = tmp_path / "run"
    run.mkdir()
    # a step that is not a number, bytes that are not text: skipped with the warning, where they were tracebacks
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "reward/mean": 0.5}\n{"step": "abc"}\n\xff\xfe{"x"\n'
                                        b'{"step": null}\n{"step": 2, "reward/mean": 0.6}\n')
    with pytest.raises(SystemExit):  # failed after drawing (and, in the planner's --png, after its table)
        main([str(run), "--out", str(tmp_path / "c.txt")])
    assert "its suffix .txt is no image format matplotlib writes" in capsys.readouterr().err
    with caplog.at_level("WARNING", logger="rl.observe"):
        main([str(run), "--out", str(tmp_path / "c.")])  # printed "c." and wrote c.png
    assert capsys.readouterr().out.strip() == str(tmp_path / "c.png") and (tmp_path / "c.png").is_file()
    assert "skipped lines 2, 3, 4 (not a metrics row)" in caplog.text


def test_the_demo_checks_both_destinations_before_writing_either(tmp_path, capsys):
    from m3jax.demo import main
    (tmp_path / "native" / "sub").mkdir(parents=True)
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert f"destination {tmp_path / 'native'} exists and is not a checkpoint directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["native"]  # released/ was written before the traceback


def test_the_planner_refuses_a_compiled_depth_of_no_layers(capsys):
    from m3jax.plan.__main__ import main
    with pytest.raises(SystemExit):  # passed, printed the plan, then the compile's subprocess failed
        main(["--config", TINY, "--compile", "--compile-layers", "2:2,0:0"])
    out = capsys.readouterr()
    assert "expected dense:moe pairs of at least one layer" in out.err and out.out == ""


def test_model_files_of_the_wrong_kind_are_one_error(tmp_path):
    """A config.json or a *.safetensors that is a directory raised IsADirectoryError, and a 401-digit rope_theta
    OverflowError, as tracebacks (and the trainer left a half-made run directory behind)."""
    import m3jax
    from flax import nnx

    from m3jax.config import ConfigError, M3Config
    from m3jax.hf.safetensors_io import CheckpointError
    from rl.config import load_config
    base = m3jax.save_pretrained(m3jax.M3ForCausalLM(load_config(TINY).model.m3_config(), rngs=nnx.Rngs(0)),
                                 str(tmp_path / "base"))
    for name in ("cfg_dir", "st_dir", "theta"):
        shutil.copytree(base, tmp_path / name)
    os.remove(tmp_path / "cfg_dir" / "config.json")
    (tmp_path / "cfg_dir" / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json is a directory: expected the config.json file"):
        M3Config.from_pretrained(str(tmp_path / "cfg_dir"))
    st = next(f for f in os.listdir(tmp_path / "st_dir") if f.endswith(".safetensors"))
    os.remove(tmp_path / "st_dir" / st)
    (tmp_path / "st_dir" / st).mkdir()
    with pytest.raises(CheckpointError, match=f"{st}: not a file; expected a safetensors file"):
        m3jax.from_pretrained(str(tmp_path / "st_dir"))
    raw = json.loads((tmp_path / "theta" / "config.json").read_text())
    raw["rope_theta"] = 10 ** 400
    raw.get("rope_parameters", {}).pop("rope_theta", None)
    (tmp_path / "theta" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="'rope_theta' = inf is not supported: expected a positive finite number"):
        M3Config.from_pretrained(str(tmp_path / "theta"))
    with pytest.raises(ConfigError, match="'layer_types' = 'full_attention' .* not one string"):
        M3Config(**{**load_config(TINY).model.tiny, "layer_types": "full_attention"})


def test_an_export_into_the_runs_checkpoints_is_refused(tmp_path):
    """The next resume took it for a damaged checkpoint step and renamed it aside (`5.unreadable`)."""
    from rl.config import load_config
    from rl.policy import export_latest
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}"])
    with pytest.raises(FileExistsError, match="is inside the run's checkpoints directory"):
        export_latest(cfg, str(tmp_path / "checkpoints" / "5"))
    assert os.listdir(tmp_path) == []


def test_a_run_trained_without_resume_can_be_scored_and_exported_with_its_own_config(tmp_path, capsys):
    """checkpoint.resume = false refused m3jax.eval and train --export on the run's own checkpoints ("a fresh run
    there would mix with them"): the check is a training run's."""
    from m3jax import train
    from rl.config import ConfigError, load_config
    (tmp_path / "checkpoints" / "20").mkdir(parents=True)
    overrides = ["checkpoint.resume=false", f"run.out_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="checkpoint.resume = false: .* already holds checkpoints"):
        load_config(TINY, overrides)
    assert load_config(TINY, overrides, training=False).checkpoint.resume is False
    # train --export goes past the config (here to the checkpoint, which is an empty directory)
    assert train.main(["--config", TINY, *overrides, "--export", str(tmp_path / "export")]) != 2
    assert "checkpoint.resume" not in capsys.readouterr().err


def test_the_eval_command_checks_the_evaluation_as_a_run_that_evaluates(capsys):
    """With eval.every_steps 0 the run never evaluates, and the command loaded the checkpoint before failing on
    eval.max_new_tokens past the positions (a traceback) or a temperature below 1e-30."""
    from m3jax import eval as eval_command
    argv = ["--config", TINY, "eval.every_steps=0", "eval.at_start=false", "eval.max_new_tokens=100",
            "eval.temperature=1e-35"]
    assert eval_command.main(argv) == 2
    err = capsys.readouterr().err
    assert "eval.max_prompt_tokens + eval.max_new_tokens = 8 + 100 = 108: more positions" in err
    assert "eval.temperature = 1e-35" in err


def test_audit_s52_the_planner_takes_a_config_without_a_model_section_and_overrides_after_a_flag(tmp_path, capsys):
    """A config with no `model:` mapping was a KeyError / AttributeError traceback; an override after a flag was
    'unrecognized arguments' (train and eval take it)."""
    from m3jax.plan.__main__ import main
    (tmp_path / "none.yaml").write_text("run:\n  name: x\n")
    (tmp_path / "list.yaml").write_text("model: [1]\n")
    assert main(["--config", str(tmp_path / "none.yaml"), "--model", "release"]) == 2
    assert capsys.readouterr().err.startswith("config error:\n")
    assert main(["--config", str(tmp_path / "list.yaml")]) == 2
    assert "model = [1]: wrong type (a list)" in capsys.readouterr().err
    assert main(["--config", TINY, "grpo.group_size=8", "--top", "3", "optim.lr=3e-4"]) == 0
    capsys.readouterr()
    # --model config on a recipe whose model.path is left required planned the released model without a word
    assert main(["--config", "configs/recipes/m3-32node.yaml", "--model", "config"]) == 2
    assert "model.path is left required (???)" in capsys.readouterr().err


def test_audit_s52_a_plot_it_cannot_write_is_one_error_line(tmp_path, capsys):
    from m3jax.plot import main
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.6}\n')
    with pytest.raises(SystemExit) as e:  # a PermissionError traceback
        main([str(run), "--out", "/proc/curves.png"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: /proc/curves.png cannot be written ("), err
    assert "Traceback" not in err


@pytest.mark.parametrize("command, argv", [
    ("m3jax.train", ["--export", "out", "--print-config"]),  # printed the config, exported nothing, status 0
    ("m3jax.eval", ["--print-config", "--step", "3"]),  # printed the config, scored nothing
    ("m3jax.eval", ["--print-config", "--hf", "x"]),  # the same (a mutation audit, session 55: untested)
])
def test_audit_s52_print_config_beside_an_action_is_refused(command, argv, tmp_path, capsys, monkeypatch):
    import importlib
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(command).main(["--config", TINY, *argv])
    assert e.value.code == 2 and "--print-config" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []

"""The planner's command line: arguments refused before anything is planned."""

import pytest


def test_target_config_is_refused_without_compile_or_a_spec_file(capsys):
    """`--target-config` (compile for compile-only GPUs of a spec) is checked before anything is planned."""
    from m3jax.plan.__main__ import main
    recipe = ["--config", "configs/recipes/m3-32node.yaml", "--model", "release"]
    with pytest.raises(SystemExit):
        main(recipe + ["--target-config", "scripts/gpu_specs/h100.txtpb"])
    assert "it needs --compile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(recipe + ["--compile", "--target-config", "scripts/gpu_specs/missing.txtpb"])
    assert "'scripts/gpu_specs/missing.txtpb': no such file" in capsys.readouterr().err


def test_compile_micro_batches_needs_compile_and_a_positive_count(capsys):
    from m3jax.plan.__main__ import main
    recipe = ["--config", "configs/recipes/m3-32node.yaml", "--model", "release"]
    for args, says in ((["--compile-micro-batches", "4"], "with --compile"),
                       (["--compile", "--compile-micro-batches", "0"], "expected a count >= 1")):
        with pytest.raises(SystemExit):
            main(recipe + args)
        assert says in capsys.readouterr().err


def test_compile_builds_the_configs_micro_batch_loop(monkeypatch, capsys):
    """With one micro-batch XLA removes the accumulation loop and its fp32 gradient sum (13.94 GB of the 32-node
    recipe on XLA:GPU): --compile used to build one whatever the config said."""
    import json
    import subprocess

    from m3jax.plan.__main__ import main
    sent = []

    def run(args, input, **kw):
        sent.append(json.loads(input))
        return subprocess.CompletedProcess(args, 1, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    recipe = ["--config", "configs/recipes/m3-32node.yaml", "--model", "release", "--compile"]
    for extra, want in (([], 32), (["--compile-micro-batches", "4"], 4)):
        with pytest.raises(SystemExit, match="compile on 128 simulated devices failed"):
            main(recipe + extra)
        assert sent[-1]["num_micro"] == want
    assert "the step scans 4 micro-batches" in capsys.readouterr().out

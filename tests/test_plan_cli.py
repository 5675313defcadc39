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


def test_target_config_without_the_cuda_plugin_is_one_error(capsys, monkeypatch):
    """In the CPU environment the compile's worker stopped with a traceback ("topology not implemented for cuda")."""
    from m3jax.plan import __main__ as plan_main
    recipe = ["--config", "configs/recipes/m3-32node.yaml", "--model", "release"]
    monkeypatch.setattr(plan_main, "has_cuda_plugin", lambda: False)
    with pytest.raises(SystemExit):
        plan_main.main(recipe + ["--compile", "--target-config", "scripts/gpu_specs/h100.txtpb"])
    assert "--target-config compiles with XLA's GPU compiler, which needs a jax with the CUDA plugin" in \
        capsys.readouterr().err


def test_the_cuda_plugin_is_found_where_jax_looks_for_it(tmp_path, monkeypatch):
    from m3jax.plan.compile import has_cuda_plugin
    if has_cuda_plugin():
        pytest.skip("this jax has a CUDA plugin, so its absence cannot be shown here")
    plugins = tmp_path / "jax_plugins"
    plugins.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "jax_plugins", raising=False)
    assert not has_cuda_plugin()
    (plugins / "xla_cuda12").mkdir()
    (plugins / "xla_cuda12" / "__init__.py").write_text("")
    assert has_cuda_plugin()


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

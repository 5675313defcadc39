"""scripts/gpu_check.py is run only when a GPU is lent, in one go: its checks must not break unseen on CPU.

Each kernel of its attention check runs inside a try (cuDNN raises off a GPU), so a renamed argument there would
only surface as an "error" entry in the GPU run's output; this runs the check at a small shape here and requires
every kernel but cuDNN to have run and to agree with the dense path.
"""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_check_runs_every_kernel_but_cudnn_on_cpu(capsys):
    _gpu_check().attention_kernels(True, 64)
    (line,) = capsys.readouterr().out.strip().splitlines()
    res = json.loads(line)
    assert res["check"] == "attention_kernels"
    kernels = {k: v for k, v in res.items() if isinstance(v, dict)}
    assert {"dense", "flash", "gathered_sparse", "grouped_sparse", "slots_sparse", "cudnn"} <= set(kernels)
    for name, r in kernels.items():
        if name == "cudnn":
            continue
        assert "error" not in r, (name, r)
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        if "rel_err_vs_dense" in r:
            assert r["rel_err_vs_dense"] < 1e-2, (name, r)  # bf16 against the dense path

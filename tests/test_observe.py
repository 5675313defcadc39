"""The run's own outputs (rl/observe.py) that the trainer tests do not look at directly."""

import glob
import os
import subprocess
import sys


def test_tensorboard_scalars_are_written_without_loading_torch(tmp_path):
    """tensorboardX imports torch when it is installed (1.6 s of a trainer's start); the run logger keeps it
    out, and the event file still holds the scalars. In a fresh process: this one may have torch loaded."""
    code = ("import sys; from rl.observe import RunLogger; "
            f"log = RunLogger({str(tmp_path)!r}, progress_bar=False); log.log(1, {{'reward/mean': 0.25}}); "
            "log.close(); assert 'torch' not in sys.modules, 'torch was imported'; import torch")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    events = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    assert len(events) == 1 and b"reward/mean" in open(events[0], "rb").read()

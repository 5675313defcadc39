"""`python -m m3jax.train` whose start never ends: its first argument names what never returns, `engine` (the JAX
generation engine never comes up) or `restore` (the checkpoint read, as on a filesystem that stopped answering); the
rest as m3jax.train takes them."""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rl.checkpoint import Checkpointer  # noqa: E402
from rl.generation.jax_engine import JaxEngine  # noqa: E402


def never_returns(*args, **kwargs):
    threading.Event().wait()


if __name__ == "__main__":
    stuck = sys.argv.pop(1)
    if stuck == "engine":
        JaxEngine.__init__ = never_returns
    elif stuck == "restore":
        Checkpointer.restore_latest = never_returns
    else:
        sys.exit(f"usage: {sys.argv[0]} engine|restore ARGS...")
    from m3jax.train import main
    sys.exit(main())

"""`python -m m3jax.train` whose JAX generation engine never returns from `shutdown` (the end of the run: an
engine, a filesystem or a peer that stopped answering). Arguments as m3jax.train takes them."""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rl.generation.jax_engine import JaxEngine  # noqa: E402

JaxEngine.shutdown = lambda self: threading.Event().wait()

if __name__ == "__main__":
    from m3jax.train import main
    sys.exit(main())

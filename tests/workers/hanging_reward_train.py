"""`python -m m3jax.train` with one more reward, "hangs", which never returns (inline: in the thread that scores, as
a reward stuck inside C code would hold it). Arguments as m3jax.train takes them; docs/extending.md's launcher."""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rl.rewards import register_reward  # noqa: E402


@register_reward("hangs", mode="inline")
def hangs(completion, answer, **kw):
    threading.Event().wait()


if __name__ == "__main__":
    from m3jax.train import main
    sys.exit(main())

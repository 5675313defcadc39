"""python -m m3jax.convert SRC DST [--layout native|released] [--dtype ...] [--max-shard-size 5GB] [--threads 4]
                         [--carry-from RELEASE]

Reads a local HF MiniMax-M3 checkpoint in either layout and writes it in the chosen one, in parts of about 64 MB
read and written by several threads (`m3jax.hf.convert.convert_checkpoint`: the tensors `from_pretrained` then
`save_pretrained` would write, without holding the model or even one whole tensor).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import jax.numpy as jnp

from m3jax.cli_args import description, path_argument
from m3jax.config import ConfigError
from m3jax.hf.convert import convert_checkpoint
from m3jax.hf.read_blocks import READ_THREADS
from m3jax.hf.safetensors_io import CheckpointError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m m3jax.convert", description=description(__doc__))
    ap.add_argument("src", type=path_argument, help="HF checkpoint directory to read")
    ap.add_argument("dst", type=path_argument, help="directory to write (replaced atomically if it exists)")
    ap.add_argument("--layout", choices=("native", "released"), default="native",
                    help="the tensor names and shapes written: native (this library's, default) or released (the "
                         "published checkpoint's, vision tower carried)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: the checkpoint's embedding dtype (a tensor stored wider is rounded to it, "
                         "warned of)")
    ap.add_argument("--max-shard-size", default="5GB", help="the largest shard file written (default: 5GB)")
    ap.add_argument("--carry-from", type=path_argument, default=None, metavar="DIR",
                    help="the checkpoint whose vision tower (a released result), config fields and tokenizer the "
                         "result carries (default: SRC's own); its text model must be SRC's")
    ap.add_argument("--threads", type=int, default=READ_THREADS,
                    help="parts read and written at once (more for a network filesystem)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads {args.threads}: expected at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # jax's backend probe (no TPU here, and the like) says nothing a conversion needs; the load's progress stays.
    # Restored after: main() also runs inside other processes (tests), whose logging is theirs.
    probe = logging.getLogger("jax._src.xla_bridge")
    level = probe.level
    probe.setLevel(logging.ERROR)
    t0 = time.perf_counter()
    try:
        convert_checkpoint(args.src, args.dst, layout=args.layout, dtype=DTYPES.get(args.dtype),
                           max_shard_size=args.max_shard_size, threads=args.threads, carry_from=args.carry_from,
                           progress=True)
    except (ConfigError, CheckpointError, OSError, ValueError) as e:  # ValueError: a flag's value, named
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        probe.setLevel(level)
    print(f"converted {args.src} -> {args.dst} ({args.layout} layout) in {time.perf_counter() - t0:.1f}s")
    return 0

if __name__ == "__main__":
    sys.exit(main())

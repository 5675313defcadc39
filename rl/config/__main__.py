"""python -m rl.config --config FILE [key.sub=value ...]: print the resolved config (rl.config.main)."""

import sys

from rl.config import main

sys.exit(main())

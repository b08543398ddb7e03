"""`python -m dflash_tui`: dflash-top without its console script (the trainer's attach hint uses it when
the environment's `dflash-top` is not on the path)."""

import sys

from dflash_tui.cli import main

sys.exit(main())

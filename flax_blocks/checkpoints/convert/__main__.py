"""`python -m flax_blocks.checkpoints.convert SRC DST`: the converter's command line
(`flax_blocks.checkpoints.convert.cli`)."""

import sys

from flax_blocks.checkpoints.convert.cli import main

sys.exit(main())

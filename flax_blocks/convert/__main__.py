"""`python -m flax_blocks.convert SRC DST`: the converter's command line (flax_blocks.convert_cli)."""

import sys

from flax_blocks.convert_cli import main

sys.exit(main())

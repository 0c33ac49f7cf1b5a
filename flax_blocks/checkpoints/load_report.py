"""The old home of the load report: now `flax_blocks.checkpoints.checkpoint`, which a load reads
in one module. These names keep working from here; nothing in the library imports this module."""

from .checkpoint import (  # noqa: F401
    LoadReport,
    load_report,
    make_report,
    report_ignored,
)

"""Check any port: compare a PyTorch module with its Flax NNX port layer by layer.

    from parity_tests.port import copy_weights, compare
    copy_weights(torch_model, flax_model)          # every parameter paired, or PortError
    report = compare(torch_model, flax_model, tokens)   # float64, with gradients
    print(report); report.first_divergence          # None, or the module and the reason
    report.plot("port.png")

`python -m parity_tests.port TORCH FLAX --inputs SPEC` does the same from the shell
(docs/porting.md walks through a port).
"""

from .errors import rel_err
from .report import Divergence, PortReport, Row
from .side_by_side import compare
from .weights import Copied, PortError, Transform, copy_weights, plan

__all__ = ["compare", "copy_weights", "plan", "rel_err", "Copied", "Divergence", "PortError", "PortReport", "Row",
           "Transform"]

"""fxamp: explicit, checkable mixed precision for PyTorch models via torch.fx."""
from ._version import __version__
from .errors import (CallStructureError, ExampleInputError, FxampError,  # noqa: E402
                     InputShapeError, ModeError, NotPlannedError, OverlappingRewriteError,
                     PlanFormatError, PolicyError, RuleError, TraceError,
                     UnsupportedModelError)
from .plan import NodePrecision, Plan, diff  # noqa: E402
from .policy import Override, Policy  # noqa: E402
from .rules import DecisionRule  # noqa: E402
from .rewriter import amp_rewrite, plan_of  # noqa: E402
from .rewriter.inplace import graphs_of  # noqa: E402
from .rewriter.overlap import rewritten  # noqa: E402
from .rewriter.search import SearchResult, bisect_baseline, search  # noqa: E402
from .passes.audit import Finding  # noqa: E402
from .rewriter.audit import audit  # noqa: E402
from .config import RewriteConfig  # noqa: E402
from .result import config_of  # noqa: E402
from .weight_cache import weight_cache_bytes  # noqa: E402
from . import train  # noqa: E402

__all__ = [
    "search", "bisect_baseline", "SearchResult",
    "__version__", "amp_rewrite", "plan_of", "diff", "Plan", "NodePrecision", "Policy",
    "Override", "FxampError", "TraceError", "PolicyError", "UnsupportedModelError",
    "PlanFormatError", "ExampleInputError", "InputShapeError", "CallStructureError", "ModeError",
    "NotPlannedError", "RuleError", "DecisionRule", "OverlappingRewriteError", "audit",
    "Finding", "train",
    "RewriteConfig", "config_of", "weight_cache_bytes", "rewritten", "graphs_of",
]

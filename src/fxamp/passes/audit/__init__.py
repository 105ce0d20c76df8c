"""The audit: a check pass that changes nothing, split by topic.

- :mod:`.graph`: ``audit_graph``, the entry point that runs the graph checks;
- :mod:`.findings`: ``Finding``, severities, the summary and the graph helpers the checks share;
- :mod:`.checks`: dims, casts, binary_cross_entropy;
- :mod:`.numerics`: exp, norm eps;
- :mod:`.results`: nested graphs and the eager front end's results;
- :mod:`.context`: the optional optimizer / GradScaler / batch / ONNX checks.
"""
from .findings import SEVERITIES, Finding, summary
from .graph import audit_graph
from .numerics import eps_finding, module_eps

__all__ = ["Finding", "SEVERITIES", "audit_graph", "eps_finding", "module_eps", "summary"]

"""The rewriter: tracing front ends, the amp_rewrite pipeline, run-time helpers."""
from . import fx_names  # noqa: F401 - fixes fx codegen of names with quotes
from .pipeline import amp_rewrite, plan_of

__all__ = ["amp_rewrite", "plan_of"]

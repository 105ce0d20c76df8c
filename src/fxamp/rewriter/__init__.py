"""The rewriter: tracing front ends, the amp_rewrite pipeline, run-time helpers."""
from .pipeline import amp_rewrite, plan_of

__all__ = ["amp_rewrite", "plan_of"]

"""The rewriter: the amp_rewrite pipeline (front end -> passes -> casts) and the search."""
from .pipeline import amp_rewrite, plan_of

__all__ = ["amp_rewrite", "plan_of"]

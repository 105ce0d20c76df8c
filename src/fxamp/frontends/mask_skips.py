"""Hugging Face's "no mask needed" decision, made as in eager while fxamp exports.

A bidirectional transformers model called without ``attention_mask`` builds no mask when
it runs eagerly (``masking_utils._ignore_bidirectional_mask_sdpa``: SDPA attends to every
token without one), but an all-True boolean mask of the batch's size while torch.export
runs (the helper asks ``torch.compiler.is_exporting()``). The two are different programs,
and eager under ``torch.autocast`` is the reference: a model that adds its own float bias
to the mask (BEiT's relative position bias, per layer or shared) adds ``True`` (1.0) to
the bias and broadcasts it to the batch before SDPA's cast, so the exported backward sums
the batch's bias gradients in FP32 after the cast back, where autocast's SDPA sums them in
BF16 before it: the tables' gradients differed from autocast's (up to 3% of the largest).

While fxamp exports, on the tracing thread, that helper called with no padding mask
(its decision reads no tensor then) answers with torch.compiler's flags off, as in eager
(:func:`fxamp._torch.eager_compiler_flags`). Given a padding mask, eager reads its values
(``padding_mask.all()``), which an export cannot: that call answers as under export.
Nothing changes where transformers is not imported or has no such helper.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Callable, Iterator

from .. import _torch

__all__ = ["eager_mask_skips"]

log = logging.getLogger(__name__)

#: the module holding the helper, and the helper's name there
_MODULE = "transformers.masking_utils"
_HELPER = "_ignore_bidirectional_mask_sdpa"


def _eager_answer(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (the helper), answering as in eager on the tracing thread when it is
    given no padding mask (its first argument)."""
    @functools.wraps(original)
    def skip(*args: Any, **kwargs: Any) -> Any:
        padding_mask = args[0] if args else kwargs.get("padding_mask")
        if padding_mask is None and _torch.tracing_thread():
            with _torch.eager_compiler_flags():
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    return skip


@contextlib.contextmanager
def eager_mask_skips() -> Iterator[None]:
    """Within the block (an export by fxamp), transformers' bidirectional mask skip, given
    no padding mask, is decided as in eager on this thread (see the module docstring); the
    helper is put back on every exit path. Holds fxamp's trace lock."""
    masking = sys.modules.get(_MODULE)
    original = vars(masking).get(_HELPER) if masking is not None else None
    if not callable(original):
        yield
        return
    replacement = _eager_answer(original)
    with _torch.tracing():
        setattr(masking, _HELPER, replacement)
        try:
            yield
        finally:
            if vars(masking).get(_HELPER) is replacement:
                setattr(masking, _HELPER, original)
            else:  # something else replaced it meanwhile: leave its value (it wraps ours)
                log.warning("%s.%s was replaced while fxamp exported; leaving the new value",
                            _MODULE, _HELPER)

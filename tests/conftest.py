import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from typing import List  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # (pytest -n 2: one torch thread per worker, so
    torch.set_num_threads(1)               # two workers do not oversubscribe two cores)

#: a test module that imports one of these at import time builds model-zoo models
_ZOO_LIBRARIES = ("transformers", "timm")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Mark ``slow`` (out of the fast tier, ``-m "not slow"``) every test of a module that
    holds a model-zoo library (transformers, timm) as a module attribute, so a new zoo test
    file is slow without marking it; the other slow tests carry the mark themselves."""
    zoo = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module.__name__ not in zoo:
            zoo[module.__name__] = any(
                isinstance(v, types.ModuleType) and v.__name__.split(".")[0] in _ZOO_LIBRARIES
                for v in vars(module).values())
        if zoo[module.__name__]:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def export_calls(monkeypatch) -> List[int]:
    """torch.export.export still runs (the real one); each call is counted."""
    calls: List[int] = []
    real = torch.export.export

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    return calls

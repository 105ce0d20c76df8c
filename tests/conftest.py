import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from typing import List  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


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

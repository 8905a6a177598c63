"""Shared fixtures.

`tiny_model`: the tiny DeepSeek-V3-architecture model (`launcher/tinymodel.py`), generated once
into vlaunch's cache folder (`$VLAUNCH_CACHE_DIR` or XDG) and reused by every test and run.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    pytest.importorskip("torch", reason="generating the tiny model needs torch")
    pytest.importorskip("safetensors", reason="generating the tiny model needs safetensors")
    pytest.importorskip("tokenizers", reason="generating the tiny model needs tokenizers")
    from launcher.run.tinymodel import ensure_tiny_model

    return ensure_tiny_model()

"""Shared fixtures: backends and dtypes from the registry, the tolerance table, test data."""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import DTYPES
from pyengine import backends

#: Backends that must load (CI sets PYENGINE_REQUIRE=cpp,numba so a broken build fails).
REQUIRED = {b for b in os.environ.get("PYENGINE_REQUIRE", "").split(",") if b}


def require(name: str) -> str:
    """Skip (with the reason) if backend ``name`` cannot load, or fail if it is required."""
    info = backends.available_backends()[name]
    if not info.available:
        if name in REQUIRED:
            pytest.fail(f"required backend {name} failed to load: {info.reason}")
        pytest.skip(f"backend {name} unavailable: {info.reason}")
    return name


@pytest.fixture(params=backends.BACKENDS, scope="session")
def backend(request) -> str:
    """Every registered backend, the reference included."""
    return require(request.param)


@pytest.fixture(params=[b for b in backends.BACKENDS if b != "numpy"], scope="session")
def compiled(request) -> str:
    """Every compiled backend (everything but the reference)."""
    return require(request.param)


@pytest.fixture(params=DTYPES, ids=lambda t: np.dtype(t).name, scope="session")
def dtype(request):
    return request.param


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache folder, set as HF_HUB_CACHE for the test."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache

"""Worker-local state: each process loads a model once and warms its kernels once.

Tasks name a model by a string (a :func:`pyengine.load_pretrained` name or path, or
``"default"`` / ``"tiny"`` for seeded synthetic stacks); :func:`get_model` keeps one
loaded copy per process (a worker of a ``LocalCluster`` with ``processes=True`` is a
process), so Numba functions and pybind11 objects never travel through pickle.
:func:`loads` counts the loads of this process (tests check "once per worker").
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["SYNTHETIC", "clear", "get_model", "loads"]

#: Synthetic model names -> (StackConfig arguments, init seed). ``default`` is the
#: GPT-2-small-shaped stack of ``pyengine recovery``; ``tiny`` a 4-block d = 64 one for tests.
SYNTHETIC: dict[str, dict[str, Any]] = {
    "default": dict(d_model=768, n_heads=12, n_layers=12, d_mlp=3072, norm="layernorm", placement="pre",
                    activation="gelu_tanh", positions="learned", vocab_size=256, max_seq_len=1024),
    "tiny": dict(d_model=64, n_heads=4, n_layers=4, d_mlp=256, norm="layernorm", placement="pre",
                 activation="gelu_tanh", positions="learned", vocab_size=256, max_seq_len=1024),
}

_lock = threading.Lock()
_models: dict[tuple[str, str], Any] = {}
_loads = [0]


def _load(name: str) -> Any:
    from ..models import StackConfig, init_weights, load_pretrained

    if name in SYNTHETIC:
        return init_weights(StackConfig(**SYNTHETIC[name]), scheme="gpt2", seed=0, dtype=np.float32)
    return load_pretrained(name)


def _warm(model: Any) -> None:
    """Compile/load every kernel a task will use, so the first point does not pay for it."""
    from ..linalg.spectral import layer_norm_spectral_norm, rms_norm_spectral_norm

    ids = np.zeros(4, np.int64)
    if model.config.vocab_size:
        model.forward(ids, cache_from=0)
    x = np.random.default_rng(0).standard_normal((4, model.config.d_model)).astype(model.dtype)
    (layer_norm_spectral_norm if model.config.norm == "layernorm" else rms_norm_spectral_norm)(x)


def get_model(name: str, dtype: str = "float32") -> Any:
    """The model ``name`` in ``dtype``, loaded (and warmed) once per process."""
    key = (name, dtype)
    with _lock:
        if key not in _models:
            model = _load(name)
            if np.dtype(dtype) != model.dtype:
                model = model.astype(dtype)
            _warm(model)
            _models[key] = model
            _loads[0] += 1
        return _models[key]


def loads() -> int:
    """How many models this process has loaded."""
    return _loads[0]


def clear() -> None:
    """Forget the loaded models (tests)."""
    with _lock:
        _models.clear()
        _loads[0] = 0

"""sigma_max of weight matrices, with the RMS -> RMS operator norm of the "spectral condition".

:func:`weight_scan` takes a dict or list of 2-D weight matrices and returns a
:class:`~pyengine.linalg.results.WeightScan`: sigma_max (a dense SVD for matrices up
to ``WEIGHT_SVD_MAX`` on their short side, Lanczos above), ``rms_to_rms`` and the
ratio to the spectral-condition target ``sqrt(d_out / d_in)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _validate as _v
from ..backends import one_blas_thread
from .results import WeightScan
from .spectral import spectral_norm

__all__ = ["weight_scan"]

#: weight_scan: matrices up to this min(d_out, d_in) get a dense SVD, larger ones Lanczos.
WEIGHT_SVD_MAX = 1024
#: ... and those of at most this many entries it in one BLAS thread.
WEIGHT_SVD_ONE_THREAD = 1 << 23


def weight_scan(
    weights: Mapping[str, Any] | Sequence[Any], layout: str = "out_in", tol: float = 1e-10, seed: int = 0,
) -> WeightScan:
    """sigma_max, the RMS -> RMS norm and the spectral-condition ratio of weight matrices.

    Parameters
    ----------
    weights : dict name -> 2-D array, or a list of 2-D arrays (named "0", "1", ...)
        Real float matrices.
    layout : {"out_in", "in_out"}, default "out_in"
        "out_in": W has shape (d_out, d_in), ``y = W x`` (torch.nn.Linear.weight);
        "in_out": shape (d_in, d_out), ``y = x W`` (GPT-2 Conv1D, JAX).
    tol : float, default 1e-10
        Residual tolerance for matrices too large for a dense SVD (min side
        over 1024), which use ``spectral_norm(method="lanczos")``.
    seed : int, default 0

    Returns
    -------
    WeightScan
        Arrays in the order of ``weights``; ``to_text()`` gives a table.

    Raises
    ------
    TypeError, ValueError
        Not a list/dict, a matrix that is not 2-D, not float, empty or not finite.
    """
    import scipy.linalg

    layout = _v.choice("layout", layout, ("out_in", "in_out"))
    if isinstance(weights, Mapping):
        items = [(str(k), w) for k, w in weights.items()]
        label = "weights[{!r}]"
    elif isinstance(weights, Sequence) and not isinstance(weights, (str, bytes)) and not isinstance(weights, np.ndarray):
        items = [(str(i), w) for i, w in enumerate(weights)]
        label = "weights[{}]"
    else:
        raise TypeError(f"weights must be a dict of name -> matrix or a list of matrices; got {type(weights).__name__}")
    tol = _v.tol(tol)
    names, dout, din, sig, conv = [], [], [], [], []
    for i, (name, w) in enumerate(items):
        arg = label.format(name if isinstance(weights, Mapping) else i)
        arr = _v.float_array(arg, w)
        if arr.ndim != 2 or 0 in arr.shape:
            raise ValueError(f"{arg} must be a non-empty 2-D matrix; got shape {arr.shape}")
        _v.finite(arg, arr)
        do, di = arr.shape if layout == "out_in" else arr.shape[::-1]
        if min(arr.shape) <= WEIGHT_SVD_MAX:
            # Threaded LAPACK on block-sized matrices stalls on a busy machine (barriers wait
            # for descheduled threads) and gains little on a quiet one; embeddings keep threads.
            with one_blas_thread() if arr.size <= WEIGHT_SVD_ONE_THREAD else contextlib.nullcontext():
                s, ok = float(scipy.linalg.svdvals(arr.astype(np.float64, copy=False), check_finite=False)[0]), True
        else:
            r = spectral_norm(arr, method="lanczos", tol=tol, seed=seed)
            s, ok = float(r.sigma[0]), bool(r.converged[0])
        names.append(name)
        dout.append(do)
        din.append(di)
        sig.append(s)
        conv.append(ok)
    dout_a, din_a, sig_a = np.array(dout, np.int64), np.array(din, np.int64), np.array(sig)
    target = np.sqrt(dout_a / din_a) if len(names) else np.zeros(0)
    rms = sig_a * np.sqrt(din_a / dout_a) if len(names) else np.zeros(0)
    return WeightScan(name=tuple(names), d_out=dout_a, d_in=din_a, sigma_max=sig_a, rms_to_rms=rms,
                      target=target, ratio=sig_a / target if len(names) else np.zeros(0),
                      converged=np.array(conv, bool))

"""Live ``transformers`` models -> :class:`~pyengine.models.pretrained.PretrainedModel`, in memory.

A model object is read through ``model.config`` and its state dict by the same
family readers as a saved folder, so the result equals ``load_pretrained(folder)`` of
``model.save_pretrained(folder)`` bit for bit. Nothing here imports torch: a model is
recognised by its class hierarchy, and tensors are converted by their own methods.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .. import _validate as _v
from . import _hf

#: torch dtype (as ``str(tensor.dtype)``) -> safetensors dtype name, for the same messages.
_KINDS = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def is_hf_model(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers.PreTrainedModel`` (found without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(obj).__mro__)


class StateDict:
    """A model's ``state_dict()`` with the reading interface of :class:`._hf.Safetensors`."""

    def __init__(self, tensors: dict[str, Any], where: str) -> None:
        self.where, self.tensors = where, tensors
        self.info = {n: (_KINDS.get(str(t.dtype), str(t.dtype).removeprefix("torch.")), tuple(t.shape))
                     for n, t in tensors.items()}

    @property
    def names(self) -> set[str]:
        return set(self.info)

    def get(self, name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """Tensor ``name`` as a new array of ``dtype``, checked for shape and finiteness.

        F16 and BF16 are widened exactly, F64 rounded as NumPy rounds (as a saved file is read).
        """
        where = self.where
        kind = _hf.float_kind(self.info, name, shape, where)
        try:
            t = self.tensors[name].detach().cpu()
            t = t.float() if kind == "BF16" else t  # exact: bfloat16 is the top half of a float32
            a = np.array(t.numpy(), dtype=dtype)
        except Exception as exc:  # e.g. a meta tensor, which holds no values
            raise ValueError(f"{where}: tensor {name!r} cannot be read ({type(exc).__name__}: {exc})") from None
        _v.finite(f"{where}: tensor {name!r}", a)
        return a


def read(model: Any, dtype: np.dtype) -> tuple[dict[str, Any], StateDict, str]:
    """``(config dict, tensors, where)`` of a live model, for the readers of :mod:`.pretrained`."""
    where = f"{type(model).__name__} object"
    try:
        hf = model.config.to_dict()
        tensors = saved_state_dict(model)
    except Exception as exc:  # a half-built or foreign object: say which step failed
        raise ValueError(f"{where}: its config or state_dict cannot be read ({type(exc).__name__}: {exc})") from None
    return hf, StateDict(dict(tensors), where), where


def saved_state_dict(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` under the names and with the tied copies that ``save_pretrained``
    writes: transformers 5 renames some tensors in memory (GPT-NeoX's ``embed_out`` is
    ``lm_head``) and reverts that when saving, with the functions used here."""
    tensors = dict(model.state_dict())
    utils = sys.modules.get("transformers.modeling_utils")  # loaded: the model's class comes from it
    untie = getattr(utils, "remove_tied_weights_from_state_dict", None)
    revert = getattr(utils, "revert_weight_conversion", None)
    if untie is not None:
        tensors = untie(tensors, model)
    if revert is not None:
        tensors = revert(model, tensors)
    return tensors


def copy_tokenizer(tokenizer: Any) -> Any:
    """A copy of a tokenizers.Tokenizer (or a fast transformers tokenizer's), padding and truncation off."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers fast tokenizer wraps one
    if not (hasattr(backend, "to_str") and hasattr(backend, "encode")):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer or a fast transformers tokenizer; "
                        f"got {type(tokenizer).__name__}")
    tok = _hf.need("tokenizers").Tokenizer.from_str(backend.to_str())
    tok.no_padding()
    tok.no_truncation()
    return tok

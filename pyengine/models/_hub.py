"""Models in the local Hugging Face cache, found by repo id ("org/name"), never downloaded.

The cache folder is the one huggingface_hub uses, read from the environment at each call
(``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``XDG_CACHE_HOME``/huggingface/hub, else
``~/.cache/huggingface/hub``), so a changed environment is honoured without re-importing.
"""

from __future__ import annotations

import importlib
import os
import re

#: A Hugging Face repo id: "name" or "org/name" (letters, digits, "-", "_", ".").
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_repo_id(raw: str) -> bool:
    return _REPO_ID.fullmatch(raw) is not None and ".." not in raw and not raw.endswith((".", ".gguf"))


def cache_dir() -> str:
    """The Hugging Face hub cache folder that the current environment names."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def find(repo_id: str) -> tuple[str | None, str]:
    """``(snapshot folder of the cached main revision or None, what was looked for)``."""
    cache = cache_dir()
    looked = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    try:
        hub = importlib.import_module("huggingface_hub")
    except ImportError:
        return None, f"{looked} (not searched: huggingface_hub is not installed)"
    try:
        return hub.snapshot_download(repo_id, cache_dir=cache, local_files_only=True), looked
    except Exception:  # LocalEntryNotFoundError, an incomplete snapshot, an id the hub refuses
        return None, looked

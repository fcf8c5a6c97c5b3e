"""The Python standard library's source code as a byte-level corpus with long-range structure.

Every ``.py`` file under the running interpreter's stdlib folder, less test code (files under a
``test``, ``tests`` or ``idle_test`` folder and files named ``test_*.py``) and installed packages
(``site-packages``), in sorted path order. A file goes to the held-out split when the first 8 hex
digits of sha256(its path relative to the stdlib folder) are 0 modulo 10 (about a tenth of the
files; the split depends on the path alone, so it is the same whatever else changes). Tokens are
the file's bytes (0..255) with the end-of-text token 256 after each file (vocabulary 257, the
``bytes`` tokenizer's). The content depends on the Python version, so ``info()`` records it and a
sha256 of the sorted file list and contents: two runs compare only if those match.
"""
from __future__ import annotations

import functools
import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAME = "python-stdlib-code"
VOCAB_SIZE = 257
EOT = 256
HELD_OUT_MODULUS = 10
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    """The corpus's files, as paths relative to ``root`` (default: this interpreter's stdlib), sorted."""
    root = stdlib_root() if root is None else Path(root)
    rel = (p.relative_to(root) for p in root.rglob("*.py"))
    return sorted(p for p in rel if not _SKIP_DIRS.intersection(p.parts[:-1]) and not p.name.startswith("test_"))


def is_held_out(rel: Path) -> bool:
    return int(hashlib.sha256(rel.as_posix().encode()).hexdigest()[:8], 16) % HELD_OUT_MODULUS == 0


@dataclass
class CodeCorpus:
    train: np.ndarray  # uint16 tokens
    val: np.ndarray
    info: dict
    vocab_size: int = VOCAB_SIZE


def build(root: Path | None = None) -> CodeCorpus:
    """Read, split and tokenise the files under ``root`` (default: this interpreter's stdlib)."""
    root = stdlib_root() if root is None else Path(root)
    files = source_files(root)
    if not files:
        raise ValueError(f"no .py files under {root}")
    digest = hashlib.sha256()
    parts: dict = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    for rel in files:
        data = (root / rel).read_bytes()
        digest.update(rel.as_posix().encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        split = "val" if is_held_out(rel) else "train"
        parts[split].append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
        parts[split].append(np.array([EOT], dtype=np.uint16))
        counts[split] += 1
    if not parts["val"] or not parts["train"]:
        raise ValueError(f"the files under {root} do not fill both splits: {counts}")
    train, val = (np.concatenate(parts[s]) for s in ("train", "val"))
    info = {"name": NAME, "python": sys.version.split()[0], "implementation": sys.implementation.name,
            "files": len(files), "train_files": counts["train"], "val_files": counts["val"],
            "train_tokens": int(train.size), "val_tokens": int(val.size), "sha256": digest.hexdigest(),
            "tokens": "bytes 0..255, end-of-text 256 after each file"}
    return CodeCorpus(train, val, info)


@functools.lru_cache(maxsize=None)
def load() -> CodeCorpus:
    """This interpreter's corpus, read once per process."""
    return build()

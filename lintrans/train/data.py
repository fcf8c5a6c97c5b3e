"""Training data: sources -> one cached token memmap -> train/val views -> random-window batches.

A source spec is one of
  ``builtin:python-docs``        the embedded corpus (see ``corpus.py``)
  ``PATH.txt`` / ``DIR`` / glob  text files (a folder means every non-hidden file under it)
  ``PATH.bin``                   a nanoGPT token file (``data.bin_dtype``, uint16 by default)
  ``DIR`` with train.bin+val.bin a nanoGPT dataset folder, used as it is
  ``hf:NAME[:CONFIG]``           a Hugging Face dataset already in the local cache (or a folder
                                 written by ``Dataset.save_to_disk``); needs ``datasets`` installed
Text is tokenised once, documents separated by the end-of-text token, into ``tokens.bin`` under a
cache folder keyed by the hash of the source's bytes and the tokenizer. The split is a tail split:
the last ``val_fraction`` of the tokens are the validation set (nanoGPT's convention; zero-copy).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from lintrans._io import FileLock, atomic_write_text
from lintrans._platform import cache_dir
from lintrans.checks import check_choice, check_number

from .config import BIN_DTYPES as BIN_DTYPE_NAMES
from .tokenizer import GPT2_RANKS_SHA256

CACHE_FORMAT = 1
BIN_DTYPES = {name: np.dtype(name).type for name in BIN_DTYPE_NAMES}


def default_cache_dir() -> Path:
    return cache_dir() / "data"


def cache_folder(cache_dir=None) -> Path:
    """The token cache's folder: data.cache_dir, or the default."""
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocabulary of {vocab_size} tokens is larger than uint32 token files can hold")


def check_vocab_fits(vocab_size: int, dtype: np.dtype, what: str) -> None:
    capacity = np.iinfo(dtype).max + 1
    if vocab_size > capacity:
        raise ValueError(
            f"vocabulary of {vocab_size} tokens does not fit in {what} of dtype {np.dtype(dtype).name} "
            f"(at most {capacity} ids); use uint32 token files (data.bin_dtype = 'uint32')"
        )


# ---- sources ---------------------------------------------------------------------------------


@dataclass
class TextSource:
    """Documents from the built-in corpus, text files or a Hugging Face dataset."""

    spec: str
    files: list[Path] = field(default_factory=list)  # text files, or the files the built-in corpus reads
    builtin: str | None = None
    hf: tuple[str, str | None] | None = None
    hf_split: str = "train"
    hf_column: str = "text"

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        if self.hf is not None:
            h.update(json.dumps([self.hf, self.hf_split, self.hf_column]).encode())
            h.update(_load_hf(self)._fingerprint.encode())
            return h.hexdigest()
        if self.builtin is not None:
            from .corpus import CORPUS_VERSION

            h.update(f"{self.builtin}:{CORPUS_VERSION}".encode())
        for path in self.files:
            h.update(str(path.name if self.builtin is None else path).encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())
        return h.hexdigest()

    def documents(self) -> Iterator[str]:
        if self.builtin is not None:
            from .corpus import builtin_corpus

            yield from builtin_corpus(self.builtin)
        elif self.hf is not None:
            for row in _load_hf(self):
                yield row[self.hf_column]
        else:
            for path in self.files:
                try:
                    yield path.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"data file {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        "select only text files, e.g. with a glob like 'DIR/**/*.txt'"
                    ) from None


@dataclass
class TokenSource:
    """Pre-tokenised nanoGPT files: one ``.bin`` to split, or a folder with train.bin and val.bin."""

    spec: str
    path: Path
    dtype: np.dtype
    presplit: bool


def resolve_source(spec: str, *, bin_dtype: str = "uint16", hf_split: str = "train", hf_column: str = "text",
                   exclude=()):
    """Turn a source spec (see module doc) into a TextSource or TokenSource; clear errors if absent/empty.
    ``exclude``: folders whose files a folder or glob source leaves out (a run's own cache and output:
    they would otherwise become part of its data)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"data.source must be a non-empty string, got {spec!r}")
    check_choice("data.bin_dtype", bin_dtype, BIN_DTYPES)
    if spec.startswith("builtin:"):
        from .corpus import builtin_corpus_files

        name = spec[len("builtin:"):]
        return TextSource(spec, files=builtin_corpus_files(name), builtin=name)
    if spec.startswith("hf:"):
        name, _, config = spec[len("hf:"):].partition(":")
        return TextSource(spec, hf=(name, config or None), hf_split=hf_split, hf_column=hf_column)
    path = Path(spec).expanduser()
    dtype = np.dtype(BIN_DTYPES[bin_dtype])
    # only folders strictly inside the source's root: a source inside the cache or out_dir is the user's
    fixed = Path(*[part for part in path.parts[:next((i for i, part in enumerate(path.parts)
                                                      if any(c in part for c in "*?[")), len(path.parts))]])
    root = (path if path.is_dir() else fixed).resolve()
    excluded = [e for e in (Path(x).resolve() for x in exclude if x is not None) if root in e.parents]

    def kept(p: Path) -> bool:
        if not excluded:
            return True
        real = p.resolve()
        return not any(real == e or e in real.parents for e in excluded)

    # an existing file or folder is itself, whatever characters its name holds ("notes[v2].txt")
    if path.is_dir():
        if (path / "train.bin").is_file() and (path / "val.bin").is_file():
            return TokenSource(spec, path, dtype, presplit=True)
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts) and kept(p)
        )
        if not files:
            raise ValueError(f"data.source folder {path} holds no files")
    elif path.is_file():
        if path.suffix == ".bin":
            return TokenSource(spec, path, dtype, presplit=False)
        files = [path]
    elif any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file() and kept(Path(p)))
        if not files:
            raise FileNotFoundError(f"data.source glob {spec!r} matches no files")
    else:
        raise FileNotFoundError(f"data.source {spec!r}: no such file or folder")
    bins = [f for f in files if f.suffix == ".bin"]
    if bins and len(files) == 1:
        return TokenSource(spec, files[0], dtype, presplit=False)
    if bins:  # token files are not text, and several are not one token stream either
        raise ValueError(f"data.source {spec!r} holds {len(files)} files, {len(bins)} of them .bin token files "
                         f"(e.g. {bins[0]}): give one .bin file, a folder with train.bin and val.bin, or text "
                         "files only (a glob like 'DIR/**/*.txt')")
    return TextSource(spec, files=files)


def _load_hf(source: TextSource):
    """The cached Hugging Face dataset, loaded strictly offline (no download at run time)."""
    # before the import: datasets and huggingface_hub read these once, when they load
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data.source {source.spec!r} needs the 'datasets' package: pip install datasets") from None
    name, config = source.hf
    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[source.hf_split]
    else:
        try:
            ds = datasets.load_dataset(name, config, split=source.hf_split)
        except Exception as e:  # datasets raises many types; all mean "not usable offline"
            raise ValueError(
                f"Hugging Face dataset {name!r} (config {config!r}, split {source.hf_split!r}) is not in the "
                f"local cache and nothing is downloaded at run time: {e}"
            ) from None
    if source.hf_column not in ds.column_names:
        raise ValueError(
            f"Hugging Face dataset {name!r} has no column {source.hf_column!r} "
            f"(data.hf_text_column); columns are {ds.column_names}"
        )
    return ds


# ---- tokenised data --------------------------------------------------------------------------


IDENTITY_SAMPLES, IDENTITY_SPAN = 256, 4096  # places and bytes per place that TokenData.identity hashes


@dataclass
class TokenData:
    """Train and validation token arrays (read-only memmaps) plus where they came from."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    meta: dict

    def identity(self) -> dict:
        """What a checkpoint records of its data, for a resume to check: the split sizes and a hash of
        the tokens at IDENTITY_SAMPLES evenly spaced places in each split (a few MB read whatever the
        size; not the cache key, which names a path for the embedded corpus)."""
        h = hashlib.sha256()
        for arr in (self.train, self.val):
            n = len(arr)
            span = max(1, IDENTITY_SPAN // max(arr.itemsize, 1))
            starts = sorted({(n - span) * i // (IDENTITY_SAMPLES - 1) for i in range(IDENTITY_SAMPLES)}) if n > span else [0]
            for start in starts:
                h.update(np.ascontiguousarray(arr[start:start + span]).tobytes())
        return {"train_tokens": int(len(self.train)), "val_tokens": int(len(self.val)), "sample_sha256": h.hexdigest()}

    def check_block_size(self, block_size: int) -> None:
        for split, arr in (("training", self.train), ("validation", self.val)):
            if len(arr) < block_size + 1:
                raise ValueError(
                    f"the {split} split of {self.meta['source']!r} has {len(arr)} tokens, fewer than "
                    f"block_size + 1 = {block_size + 1}; use more data, a smaller block_size"
                    + (" or a larger data.val_fraction" if split == "validation" and "val_fraction" in self.meta else "")
                )


def prepare_data(
    source,
    tokenizer,
    *,
    val_fraction: float = 0.05,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> TokenData:
    """Tokenise ``source`` once (cached) and return its train/val split."""
    check_number("data.val_fraction", val_fraction, low=0, high=1, low_open=True, high_open=True)
    if isinstance(source, TokenSource):
        return _token_file_data(source, tokenizer.vocab_size, val_fraction)
    dtype = token_dtype(tokenizer.vocab_size)
    tok_id = tokenizer.name + (":" + GPT2_RANKS_SHA256 if tokenizer.name == "gpt2" else "")
    key = hashlib.sha256(
        json.dumps([CACHE_FORMAT, source.fingerprint(), tok_id, dtype.name]).encode()
    ).hexdigest()[:20]
    folder = cache_folder(cache_dir)
    entry = folder / key
    if not (entry / "meta.json").is_file():
        _tokenize_to_cache(source, tokenizer, dtype, entry, progress)
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as e:  # renamed whole: only a crash before the disk had it, or a hand, did this
        raise ValueError(f"the token cache entry {entry} is damaged (meta.json unreadable: {e}): delete that folder "
                         "and run again to tokenise anew") from None
    size = (entry / "tokens.bin").stat().st_size if (entry / "tokens.bin").is_file() else None
    if size != meta.get("tokens", -1) * dtype.itemsize:  # written whole and renamed: only a disk or a hand did this
        held = "no tokens.bin" if size is None else f"tokens.bin holds {size} bytes"
        raise ValueError(f"the token cache entry {entry} is damaged ({held}, meta.json says {meta.get('tokens')} "
                         f"tokens of {dtype.itemsize} bytes): delete that folder and run again to tokenise anew")
    tokens = np.memmap(entry / "tokens.bin", dtype=dtype, mode="r")
    # the spec of this run: another that named the same content differently made the entry
    return _split(tokens, tokenizer.vocab_size, val_fraction, {**meta, "source": source.spec, "cache": str(entry)})


def _tokenize_to_cache(source: TextSource, tokenizer, dtype: np.dtype, entry: Path, progress: bool) -> None:
    from tqdm.auto import tqdm

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # name the key, not only the path
        raise ValueError(f"data.cache_dir {str(entry.parent)!r} cannot be created: {e.strerror or e}") from None
    _remove_abandoned(entry.parent)
    # the owner in the name (host, pid) lets a later run tell an abandoned folder from a live one
    tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}-", dir=entry.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # a folder's usual mode: mkdtemp's 0700 would become the entry's
    n_tokens = n_docs = 0
    alive = FileLock(tmp / ".lock", warn=False)  # held while this folder is in use: see _remove_abandoned
    try:
        alive.acquire()
        with open(tmp / "tokens.bin", "wb") as f, tqdm(
            desc=f"tokenising {source.spec}", unit="doc", disable=not progress
        ) as bar:
            for batch in _batched(source.documents(), 64):
                for ids in tokenizer.encode_batch(batch):
                    arr = np.asarray(ids + [tokenizer.eot_token], dtype=dtype)
                    arr.tofile(f)
                    n_tokens += len(arr)
                n_docs += len(batch)
                bar.update(len(batch))
                bar.set_postfix(tokens=n_tokens)
            f.flush()
            os.fsync(f.fileno())  # on disk before the folder's rename makes it the cache entry
        if n_tokens == n_docs:  # only end-of-text markers: every document was empty
            raise ValueError(f"data.source {source.spec!r} holds no text")
        meta = {"source": source.spec, "tokenizer": tokenizer.name, "dtype": dtype.name,
                "documents": n_docs, "tokens": n_tokens}
        # on disk (and the folder's entry for it) before the rename, as tokens.bin
        atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1))
        try:
            os.replace(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():  # another process did not win the race: real error
                raise
    finally:
        alive.release()
        shutil.rmtree(tmp, ignore_errors=True)


_TMP_NAME = re.compile(r"^[0-9a-f]{20}\.tmp-(?P<host>.+)-(?P<pid>\d+)-[A-Za-z0-9_]+$")
ABANDONED_AFTER_S = 60


def _remove_abandoned(folder: Path) -> None:
    """Remove the temporary folders of tokenisations killed before they finished (kill -9, a lost
    machine): those made on this host by a process that no longer runs, untouched for a minute, whose
    lock (held by a live tokenisation, whatever its pid namespace) can be taken. Anything else
    (another host's, a live process's, a recent one, one on a file system without locks, a name we
    did not make) stays."""
    if os.name != "posix":
        return
    host, now = socket.gethostname(), time.time()
    for path in folder.glob("*.tmp-*"):
        m = _TMP_NAME.match(path.name)
        if not m or m["host"] != host or _pid_alive(int(m["pid"])):
            continue
        try:
            newest = max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.iterdir()])
        except OSError:  # removed meanwhile
            continue
        if now - newest < ABANDONED_AFTER_S:
            continue
        lock = FileLock(path / ".lock", blocking=False, warn=False)
        try:
            abandoned = lock.acquire() and lock.held
        except OSError:
            abandoned = False
        lock.release()  # before the removal: NFS keeps an open file, and so its folder, alive
        if abandoned:
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process (PermissionError), or cannot tell: keep
        return True
    return True


def _batched(items, n):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _token_file_data(source: TokenSource, vocab_size: int, val_fraction: float) -> TokenData:
    check_vocab_fits(vocab_size, source.dtype, f"token files {source.spec!r}")
    paths = [source.path / "train.bin", source.path / "val.bin"] if source.presplit else [source.path]
    arrays = []
    for p in paths:
        if p.stat().st_size == 0:
            raise ValueError(f"token file {p} is empty")
        if p.stat().st_size % source.dtype.itemsize:
            raise ValueError(f"token file {p} is not a whole number of {source.dtype.name} values")
        arr = np.memmap(p, dtype=source.dtype, mode="r")
        top = max(int(arr[i:i + 2**24].max()) for i in range(0, len(arr), 2**24))
        if top >= vocab_size:
            raise ValueError(
                f"token file {p} holds token id {top}, outside the tokenizer's vocabulary of {vocab_size}"
            )
        arrays.append(arr)
    meta = {"source": source.spec, "dtype": source.dtype.name, "tokens": int(sum(len(a) for a in arrays))}
    if source.presplit:
        return TokenData(arrays[0], arrays[1], vocab_size, meta)
    return _split(arrays[0], vocab_size, val_fraction, meta)


def _split(tokens: np.ndarray, vocab_size: int, val_fraction: float, meta: dict) -> TokenData:
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    if n_val >= len(tokens):
        raise ValueError(f"data.source {meta['source']!r} has only {len(tokens)} tokens: too few to split")
    return TokenData(tokens[:-n_val], tokens[-n_val:], vocab_size, {**meta, "val_fraction": val_fraction})


# ---- batches ---------------------------------------------------------------------------------


class WindowSampler:
    """Random window starts from a seeded numpy generator whose state is saved with checkpoints."""

    def __init__(self, n_tokens: int, block_size: int, seed: int):
        self.high = n_tokens - block_size  # start + block_size + 1 <= n_tokens
        if self.high < 1:
            raise ValueError(f"{n_tokens} tokens are too few for windows of block_size {block_size}")
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def draw(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.high, size=n)

    def state_dict(self) -> dict:
        return self.rng.bit_generator.state

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state


def get_batch(tokens: np.ndarray, starts: np.ndarray, block_size: int, device="cpu"):
    """Inputs and next-token targets, each [len(starts), block_size] int64."""
    idx = np.asarray(starts)[:, None] + np.arange(block_size + 1)[None, :]  # [B, T+1]
    window = torch.from_numpy(tokens[idx].astype(np.int64))
    x, y = window[:, :-1], window[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def batch_layout(tokens_per_update: int | None, batch_size: int | None, micro_batch_size: int | None,
                 block_size: int, world_size: int) -> tuple[int, int, int]:
    """(global batch, micro batch per process, accumulation steps) for one optimizer update.

    With ``tokens_per_update`` the global batch is tokens_per_update / block_size sequences, so every
    update sees the same number of tokens whatever the context length.
    """
    if tokens_per_update is not None:
        if tokens_per_update % block_size:
            raise ValueError(
                f"train.tokens_per_update ({tokens_per_update}) must be a multiple of model.block_size ({block_size})"
            )
        total = tokens_per_update // block_size
    elif batch_size is not None:
        total = batch_size
    else:
        raise ValueError("set train.batch_size or train.tokens_per_update")
    if total % world_size:
        raise ValueError(f"the global batch of {total} sequences must divide evenly over {world_size} data-parallel "
                         "processes")
    per_rank = total // world_size
    micro = per_rank if micro_batch_size is None else min(micro_batch_size, per_rank)
    if per_rank % micro:
        raise ValueError(
            f"train.micro_batch_size ({micro}) must divide the per-process batch ({per_rank} sequences = "
            f"{total} global / {world_size} data-parallel processes)"
        )
    return total, micro, per_rank // micro

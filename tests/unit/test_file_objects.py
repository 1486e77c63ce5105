"""Store.open's file objects behave as the builtin open's: text options, peek, and a closed
file that says so."""

from __future__ import annotations

import io
import pickle

import pytest

import stagefs
from conftest import random_bytes
from stagefs.fileobj import WHOLE_READ_LIMIT

LATIN = "héllo\r\nwörld\n".encode("latin-1")
BIG = random_bytes(WHOLE_READ_LIMIT + 5000, seed=4)


@pytest.fixture(scope="module")
def fs(tmp_path_factory: pytest.TempPathFactory) -> stagefs.Store:
    root = tmp_path_factory.mktemp("fileobj")
    src = root / "src"
    src.mkdir()
    (src / "latin.txt").write_bytes(LATIN)
    (src / "data.pkl").write_bytes(pickle.dumps({"k": list(range(50))}))
    (src / "big.bin").write_bytes(BIG)
    stagefs.pack(src, root / "pack", jobs=1, progress=False, echo=lambda _m: None)
    return stagefs.open(root / "pack")


def test_text_mode_takes_encoding_errors_and_newline(fs: stagefs.Store) -> None:
    with fs.open("latin.txt", "r", encoding="latin-1") as f:
        assert f.read() == "héllo\nwörld\n"
        assert f.mode == "r"
    with fs.open("latin.txt", "r", encoding="latin-1", newline="") as f:
        assert list(f) == ["héllo\r\n", "wörld\n"]
    with fs.open("latin.txt", "r", errors="replace") as f:  # UTF-8 by default
        assert f.read().startswith("h\ufffdllo")
    with fs.open("latin.txt", "r") as f, pytest.raises(UnicodeDecodeError):
        f.read()
    with pytest.raises(ValueError, match="binary"):
        fs.open("latin.txt", "rb", encoding="utf-8")


@pytest.mark.parametrize("name", ["latin.txt", "big.bin"])
def test_both_kinds_of_file_peek_without_moving(fs: stagefs.Store, name: str) -> None:
    data = fs.read(name)
    with fs.open(name) as f:
        assert f.read(3) == data[:3]
        ahead = f.peek(2)
        assert len(ahead) >= 2 and data[3:].startswith(ahead)
        assert f.tell() == 3 and f.read(2) == data[3:5]
    with pytest.raises(ValueError):
        f.peek(1)


def test_a_small_file_peeks_for_a_reader_that_uses_it(fs: stagefs.Store) -> None:
    with fs.open("data.pkl") as f:
        assert pickle.Unpickler(f).load() == {"k": list(range(50))}
        assert hasattr(f, "peek")


def test_a_closed_large_file_says_it_is_closed(fs: stagefs.Store) -> None:
    f = fs.open("big.bin")
    f.seek(-10, io.SEEK_END)
    assert f.read() == BIG[-10:]
    f.close()
    for op in (f.tell, lambda: f.seek(0), f.read):
        with pytest.raises(ValueError, match="closed"):
            op()

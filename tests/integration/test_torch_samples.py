"""FileDataset.samples is ImageFolder's list: ImageFolder's code reads ``ds.samples[i]``
in a loop, and a list built again at each look made that loop quadratic."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import stagefs
from stagefs.torch import FileDataset


def _pack(tmp_path: Path) -> Path:
    for c in ("cat", "dog"):
        (tmp_path / "raw" / c).mkdir(parents=True)
        for i in range(6):
            (tmp_path / "raw" / c / f"{i}.jpg").write_bytes(f"{c}{i}".encode())
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", progress=False, echo=lambda _m: None)
    return tmp_path / "pack"


def test_looking_into_samples_builds_them_once(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with stagefs.open(_pack(tmp_path)) as store:
        ds = FileDataset(store, root="")
        calls = []
        real = FileDataset.path_of
        monkeypatch.setattr(FileDataset, "path_of",
                            lambda self, i: calls.append(i) or real(self, i))
        looked = [ds.samples[i] for i in range(len(ds))]
        assert looked == [(f"{c}/{i}.jpg", k) for k, c in enumerate(("cat", "dog"))
                          for i in range(6)]
        assert len(calls) == len(ds)  # one path a sample, not one listing a look
        copy = pickle.loads(pickle.dumps(ds))  # the list stays in this process
        assert "_samples" not in copy.__dict__
        assert copy.samples == looked
    with pytest.raises(ValueError, match="closed"):
        ds.samples  # noqa: B018 - a closed store says so, kept list or not

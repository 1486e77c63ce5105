"""pread_full reads ranges larger than one read() may return (Linux: about 2 GiB)."""

from __future__ import annotations

import os

import pytest

from stagefs.tiers import base


def test_reads_in_parts_above_the_cap(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    monkeypatch.setattr(base, "_MAX_ONE_READ", 999)
    calls = []
    real = os.pread

    def counting(fd: int, n: int, off: int) -> bytes:
        calls.append(n)
        return real(fd, n, off)

    monkeypatch.setattr(base.os, "pread", counting)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert base.pread_full(fd, 9_000, 500) == data[500:9_500]
        assert len(calls) == 10 and max(calls) <= 999
        assert base.pread_full(fd, 9_999, 5_000) == data[5_000:]  # short at end of file
        assert base.pread_full(fd, 100, 0) == data[:100]
    finally:
        os.close(fd)

"""MPI jobs whose ranks are killed (as a test of failover does) leave MPICH's shared-memory
segments in /dev/shm; each test removes the ones its jobs made."""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

import pytest

_SEGMENTS = "/dev/shm/mpich_shm_*"


@pytest.fixture(autouse=True)
def _remove_leftover_mpich_segments() -> Iterator[None]:
    before = set(glob.glob(_SEGMENTS))
    yield
    for path in set(glob.glob(_SEGMENTS)) - before:  # the test's jobs have all ended here
        with contextlib.suppress(OSError):
            os.unlink(path)

"""What the processes of a long job leave behind when they end without closing (killed,
``os._exit``: every DataLoader worker): their leases and their counters files. A job that
runs for hours starts thousands of them; nothing of theirs may cost more with each one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagefs.runtime import HOST, Runtime
from stagefs.tiers import status as status_mod
from stagefs.tiers.status import COUNTER_SLOTS, EndedCounts, read_counts


def _dead_pid() -> int:
    """The pid of a process that has ended (reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _counters(folder: Path, name: str, pid: int, memory_reads: int) -> None:
    slots = [0] * 30
    slots[COUNTER_SLOTS.index("memory_reads")] = memory_reads
    slots[COUNTER_SLOTS.index("checksum_failures")] = 1
    (folder / name).write_bytes(b"SFSCNT1\n" + pid.to_bytes(8, "little")
                                + b"".join(s.to_bytes(8, "little") for s in slots))


def test_the_counts_of_ended_readers_are_read_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon sums its node's counters every second: the files of ended processes are
    read once, then their counts come from the cache; their pids are judged again once a
    minute (a clock of the test)."""
    folder = tmp_path / "stats"
    folder.mkdir()
    dead = _dead_pid()
    for i in range(50):
        _counters(folder, f"{dead}-{i}.counters", dead, 2)
    _counters(folder, f"{os.getpid()}-0.counters", os.getpid(), 5)  # a live reader's
    opened: list[str] = []
    real = status_mod.open_read

    def counting(path: str, flags: int = 0) -> tuple[int, os.stat_result]:
        opened.append(os.path.basename(path))
        return real(path, flags)

    monkeypatch.setattr(status_mod, "open_read", counting)
    now = [0.0]
    ended = EndedCounts(every=60.0, clock=lambda: now[0])
    first = read_counts(str(folder), ended)
    assert (first["memory_reads"], first["checksum_failures"]) == (105, 51)
    assert len(opened) == 51
    opened.clear()
    # the live reader counts on; the ended ones' files are not opened again
    _counters(folder, f"{os.getpid()}-0.counters", os.getpid(), 9)
    again = read_counts(str(folder), ended)
    assert (again["memory_reads"], again["checksum_failures"]) == (109, 51)
    assert opened == [f"{os.getpid()}-0.counters"]
    # a file removed is counted no more; one whose pid lives again (reused) is read again
    (folder / f"{dead}-0.counters").unlink()
    name = f"{dead}-1.counters"
    ended.files[name] = (os.getpid(), ended.files[name][1])  # as if its pid ran again
    _counters(folder, name, os.getpid(), 12)
    opened.clear()
    assert read_counts(str(folder), ended)["memory_reads"] == 2 * 49 + 9  # judged later
    assert opened == [f"{os.getpid()}-0.counters"]
    now[0] = 61.0
    opened.clear()
    last = read_counts(str(folder), ended)
    assert last["memory_reads"] == 2 * 48 + 12 + 9
    assert sorted(opened) == sorted([name, f"{os.getpid()}-0.counters"])
    # without the cache, every file is read, as before
    assert read_counts(str(folder)) == last


def test_leases_of_ended_processes_go_when_a_process_opens_the_runtime(
        tmp_path: Path) -> None:
    """In a cluster job no `stagefs status` of the runtime judges the leases: those of the
    readers killed went on piling up in procs/ for the whole job."""
    rt = Runtime(str(tmp_path / "rt")).open()
    try:
        dead = [_dead_pid() for _ in range(3)]
        for pid in dead:
            (Path(rt.procs) / f"{pid}@{HOST}").write_text(
                json.dumps({"pid": pid, "host": HOST, "start": 1, "cmd": "python train.py"}))
        other = f"1234@{HOST}x"  # another host's lease cannot be judged here: kept
        (Path(rt.procs) / other).write_text(
            json.dumps({"pid": 1234, "host": HOST + "x", "start": 1, "cmd": "x"}))
        again = Runtime(rt.path).open()
        try:
            assert sorted(os.listdir(rt.procs)) == sorted([f"{os.getpid()}@{HOST}", other])
        finally:
            again.unregister()
    finally:
        rt.unregister()

"""The memory a process may still use: the node's MemAvailable, or less under its control
group's limit (``stagefs._sysinfo``), read from a /proc and a /sys/fs/cgroup laid out as the
kernel lays them out."""

from __future__ import annotations

from pathlib import Path

from stagefs._sysinfo import meminfo, memory_available

GiB = 2**30


def _proc(tmp_path: Path, cgroup: str, available_kib: int = 8 * 2**20) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {16 * 2**20} kB\n"
                                  f"MemFree:         1000 kB\nMemAvailable:   {available_kib} kB\n"
                                  "HugePages_Total:       0\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text + "\n")


def test_meminfo_in_bytes(tmp_path: Path) -> None:
    m = meminfo(str(_proc(tmp_path, "0::/\n")))
    assert m["MemTotal"] == 16 * GiB and m["MemAvailable"] == 8 * GiB
    assert m["HugePages_Total"] == 0
    assert meminfo(str(tmp_path / "nowhere")) == {}


def test_no_limit_leaves_the_node_s_available_memory(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/user.slice/job\n")
    root = tmp_path / "cg"
    _write(root / "user.slice" / "job", memory_max="max", memory_current=str(GiB))
    assert memory_available(str(proc), str(root)) == 8 * GiB


def test_a_v2_limit_above_the_process_s_group_counts(tmp_path: Path) -> None:
    """Slurm limits the job's group; the process sits in a task group below it."""
    proc = _proc(tmp_path, "0::/slurm/job_7/step_0/task_0\n")
    root = tmp_path / "cg"
    _write(root / "slurm" / "job_7", memory_max=str(4 * GiB), memory_current=str(3 * GiB))
    _write(root / "slurm" / "job_7" / "step_0" / "task_0", memory_max="max",
           memory_current=str(GiB))
    assert memory_available(str(proc), str(root)) == GiB


def test_a_v1_limit(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "5:cpuset:/\n4:memory:/slurm/uid_1/job_9\n0::/\n")
    root = tmp_path / "cg"
    _write(root / "memory" / "slurm" / "uid_1" / "job_9",
           memory_limit_in_bytes=str(2 * GiB), memory_usage_in_bytes=str(GiB // 2))
    _write(root / "memory", memory_limit_in_bytes="9223372036854771712",  # v1: no limit
           memory_usage_in_bytes=str(5 * GiB))
    assert memory_available(str(proc), str(root)) == GiB + GiB // 2


def test_a_group_over_its_limit_leaves_nothing(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/job\n")
    root = tmp_path / "cg"
    _write(root / "job", memory_max=str(GiB), memory_current=str(2 * GiB))
    assert memory_available(str(proc), str(root)) == 0

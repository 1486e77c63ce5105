"""Who uses a cluster job's tier data (docs/decisions/0008-runtime-leases.md), with real
``stagefs serve`` daemons (static bootstrap, one node each) and ``stagefs.connect()`` readers:
a reader holds a lease, so ``stagefs clean`` and ``--clean-on-exit`` keep the data it reads;
and a job's clean keeps the tier data another live job of the user serves from the same
tier directory, whatever runtime paths the jobs were given."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import make_pack, start, stop, tail

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

READER = """
import sys, stagefs
fs = stagefs.connect()
paths = sys.argv[1:]
for p in paths[: len(paths) // 2]:
    fs.read(p)
print("half", flush=True)
sys.stdin.readline()  # the test stops the daemon meanwhile
src = sys.stdin.readline().strip()
bad = sum(fs.read(p) != open(f"{src}/{p}", "rb").read() for p in paths)
fs.close()
print("bad", bad, flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFS_")}
    return {**env, **extra}


def _cli(*args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stagefs.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=_env(**env))


def _serve(work: Path, name: str, pack: str, tier: Path, *extra: str
           ) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """A one-node daemon of job ``name``: its runtime ``work/rt-<name>`` and its log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (work / f"hosts-{name}").write_text(f"127.0.0.1:{port}\n")
    token = work / f"token-{name}"
    assert _cli("serve", "--new-token", token).returncode == 0
    rt, log = work / f"rt-{name}", work / f"serve-{name}.log"
    proc = start([sys.executable, "-m", "stagefs.cli", "serve", pack,
                  "--tier", f"{tier}:256MiB", "--runtime", str(rt),
                  "--hosts", str(work / f"hosts-{name}"), "--rank", "0",
                  "--token-file", str(token), "--progress", "0", *extra],
                 str(log), env=_env(STAGEFS_JOB=name))
    return proc, rt, log


def _wait_staged(proc: subprocess.Popen[bytes], rt: Path, log: Path) -> None:
    import json
    import time

    deadline = time.monotonic() + 90  # a bound on a wait, not a measurement
    while True:
        try:
            if json.loads((rt / "cluster.json").read_text()).get("staged"):
                return
        except (OSError, ValueError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, tail(str(log))
        time.sleep(0.1)


def _shards(tier: Path) -> list[str]:
    return sorted(str(p.relative_to(tier)) for p in tier.rglob("*.sfs"))


def test_clean_and_clean_on_exit_keep_what_a_connect_reader_reads(tmp_path: Path) -> None:
    pack, content = make_pack(str(tmp_path), files=60)
    tier = tmp_path / "tier"
    daemon, rt, log = _serve(tmp_path, "A", pack, tier, "--clean-on-exit")
    reader = None
    try:
        _wait_staged(daemon, rt, log)
        staged = _shards(tier)
        assert staged
        reader = subprocess.Popen([sys.executable, "-c", READER, *sorted(content)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=_env(STAGEFS_RUNTIME=str(rt)))
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "half"
        # stagefs clean names the reader, not only the daemon
        refused = _cli("clean", "--runtime", rt)
        assert refused.returncode == 1 and f"pid {reader.pid} " in refused.stderr
        assert f"pid {daemon.pid} " in refused.stderr
        # the daemon stops with --clean-on-exit: the data the reader reads stays, said so
        assert stop(daemon, signal.SIGTERM, timeout=60) == 0, tail(str(log))
        assert _shards(tier) == staged and rt.is_dir()
        kept = [line for line in tail(str(log), 20000).splitlines() if "kept" in line]
        assert len(kept) == 1 and f"pid {reader.pid} " in kept[0], tail(str(log))
        assert "stagefs clean" in kept[0] and str(rt) in kept[0]
        out, _ = reader.communicate(f"go\n{tmp_path / 'src'}\n", timeout=60)
        assert reader.returncode == 0 and out.split() == ["bad", "0"], out
    finally:
        stop(daemon)
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait()
    # the reader ended: stagefs clean removes what was kept
    proc = _cli("clean", "--runtime", rt)
    assert proc.returncode == 0, proc.stderr
    assert not _shards(tier) and not rt.exists()


@pytest.mark.parametrize("how", ["clean-on-exit", "stagefs clean"])
def test_a_jobs_clean_keeps_tier_data_another_live_job_serves(tmp_path: Path, how: str
                                                              ) -> None:
    """Jobs A and B, one dataset, one tier directory, each its own --runtime (the Slurm
    recipe's /dev/shm/stagefs-$USER/$SLURM_JOB_ID): A's clean leaves B's data."""
    pack, _ = make_pack(str(tmp_path), files=60)
    tier = tmp_path / "tier"
    extra = ("--clean-on-exit",) if how == "clean-on-exit" else ()
    a, rt_a, log_a = _serve(tmp_path, "A", pack, tier, *extra)
    b = None
    try:
        _wait_staged(a, rt_a, log_a)
        staged = _shards(tier)
        b, rt_b, log_b = _serve(tmp_path, "B", pack, tier)  # finds A's copies: copies none
        _wait_staged(b, rt_b, log_b)
        assert _shards(tier) == staged
        assert stop(a, signal.SIGTERM, timeout=60) == 0, tail(str(log_a))
        if how == "stagefs clean":  # as the recipe runs it: STAGEFS_RUNTIME set
            proc = _cli("clean", STAGEFS_RUNTIME=str(rt_a), STAGEFS_JOB="A")
            assert proc.returncode == 0, proc.stderr
        assert not rt_a.exists()  # A's own runtime goes
        assert _shards(tier) == staged, "A's clean removed the data B serves"
        assert b.poll() is None, tail(str(log_b))
    finally:
        stop(a)
        if b is not None:
            stop(b)

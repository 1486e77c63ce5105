"""A mount (and an interception) on each node of a two-node loopback cluster shows the whole
distributed dataset, whichever node holds each shard."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import free_ports, make_pack, serve_args, start, stop, tail, wait_staged

from stagefs.posix.fuse import fuse_available, is_mounted

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available())),
]




def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stagefs.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_each_node_mount_shows_the_whole_dataset(tmp_path: Path) -> None:
    work = str(tmp_path)
    pack, content = make_pack(work, files=60)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(2)))
    assert _cli("serve", "--new-token", os.path.join(work, "token")).returncode == 0
    daemons = [start(serve_args(work, pack, "--hosts", os.path.join(work, "hosts"), "--rank",
                                str(r), "--token-file", os.path.join(work, "token"),
                                "--replicas", "1"), os.path.join(work, f"daemon{r}.log"))
               for r in range(2)]
    mounts: list[str] = []
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, 2, d, log=os.path.join(work, f"daemon{r}.log"))
        want = {p: hashlib.sha1(b).hexdigest() for p, b in content.items()}
        for r in range(2):
            mp = os.path.join(work, f"mnt{r}")
            os.mkdir(mp)
            res = _cli("mount", "--connect", "--runtime", os.path.join(work, f"rt{r}"), mp)
            assert res.returncode == 0, res.stderr
            mounts.append(mp)
            got = {os.path.relpath(os.path.join(d, n), mp):
                   hashlib.sha1(Path(d, n).read_bytes()).hexdigest()
                   for d, _, fs in os.walk(mp) for n in fs}
            assert got == want
        # the interception of node 1 sees the same
        at = os.path.join(work, "lustre")
        code = ("import hashlib, json, os, sys; r = sys.argv[1]; print(json.dumps({"
                "os.path.relpath(os.path.join(d, n), r): hashlib.sha1(open(os.path.join(d, n),"
                " 'rb').read()).hexdigest() for d, _, fs in os.walk(r) for n in fs}))")
        res = _cli("run", "--connect", "--runtime", os.path.join(work, "rt1"), "--at", at, "--",
                   sys.executable, "-c", code, at)
        assert res.returncode == 0, res.stderr
        import json

        assert json.loads(res.stdout) == want
    finally:
        for mp in mounts:
            if is_mounted(mp):
                _cli("umount", mp)
        codes = [stop(d) for d in daemons]
    assert codes == [0, 0], [tail(os.path.join(work, f"daemon{r}.log")) for r in range(2)]

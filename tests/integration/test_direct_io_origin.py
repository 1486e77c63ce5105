"""A pack on a file system that maps no file shared: a FUSE mount whose files are opened with
``direct_io`` (as some network file systems' clients and user-space gateways do) refuses a
shared mapping (ENODEV). The manifest, mapped everywhere else, is then mapped privately, so
the pack opens and reads right, where it failed with a bare ``[Errno 19] No such device``.
The mount is a real one: a read-only passthrough served by libfuse in a child process."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stagefs
from stagefs.format import MANIFEST_NAME
from stagefs.posix.fuse import fuse_available, is_mounted

pytestmark = [
    pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available())),
]

PASSTHROUGH = '''
import errno, os, sys
import mfusepy as fuse

class DirectIO(fuse.Operations):
    use_ns = True
    def __init__(self, root):
        self.root = root
    def _p(self, path):
        return os.path.join(self.root, path.lstrip("/"))
    def getattr(self, path, fh=None):
        st = os.lstat(self._p(path))
        keys = ("st_gid", "st_mode", "st_nlink", "st_size", "st_uid")
        return {k: getattr(st, k) for k in keys} | {
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}
    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._p(path))
    def open(self, path, fi):
        fi.fh = os.open(self._p(path), os.O_RDONLY)
        fi.direct_io = 1
        return 0
    def read(self, path, size, offset, fi):
        return os.pread(fi.fh, size, offset)
    def release(self, path, fi):
        os.close(fi.fh)
        return 0

fuse.FUSE(DirectIO(sys.argv[1]), sys.argv[2], foreground=True, ro=True, raw_fi=True)
'''


def test_a_pack_on_a_file_system_that_maps_nothing_shared_opens_and_reads(
        tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = {f"c{k % 3}/f{k}.bin": os.urandom(1000 + 37 * k) for k in range(60)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    pack = tmp_path / "pack"
    stagefs.pack(str(src), str(pack), progress=False)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    server = subprocess.Popen([sys.executable, "-c", PASSTHROUGH, str(pack), str(mnt)],
                              stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(str(mnt)):
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "the passthrough did not mount"
            time.sleep(0.05)
        with open(mnt / MANIFEST_NAME, "rb") as f, pytest.raises(OSError) as refused:
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert refused.value.errno == 19  # ENODEV: what the pack met before
        with stagefs.open(str(mnt)) as store:
            got = dict(zip(files, store.read_many(list(files)), strict=True))
            assert got == files
            assert store.read("c1/f4.bin") == files["c1/f4.bin"]
    finally:
        # not a stagefs mount: unmounted as any FUSE mount; if busy (a failed read's frames
        # hold a descriptor), detached and its server ended
        if is_mounted(str(mnt)) and subprocess.run(["fusermount3", "-u", str(mnt)],
                                                   check=False).returncode:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
            server.kill()
        server.wait(timeout=30)
        if server.stderr:
            server.stderr.close()

"""A reader's way into its node's runtime directory when something is off: the directory is
another user's, the token file was made unreadable by its owner, or the map there is a
killed daemon's for a pack made again since (its daemon restarted on the new pack is about
to write its own). Each is a clear ClusterError (or, for the last, a wait for the new map),
never a bare "Permission denied" nor a message that names the wrong cause."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import make_dataset

import stagefs
from conftest import as_nobody, world_dir
from stagefs import cli
from stagefs.cluster import connect as connect_mod
from stagefs.cluster.cmap import ClusterMap, write_map
from stagefs.errors import ClusterError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.net.auth import new_token, read_token, write_token

pytestmark = pytest.mark.integration


@pytest.fixture()
def world() -> Iterator[Path]:
    with world_dir() as d:
        yield d


def _map(pack: str, runtime: str, token: bytes) -> None:
    """A one-node cluster map for ``pack`` (its address a port nobody listens on)."""
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    pack_id = m.pack_id.hex()
    m.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        me = s.getsockname()
    write_map(runtime, ClusterMap(pack=pack, pack_id=pack_id, rank=0, nodes=[me],
                                  replicas=1, seed=0, everywhere=[], replicate_all=[],
                                  tiers=[], staged=True, pid=os.getpid()), token)


def test_a_token_file_its_owner_made_unreadable_is_not_called_another_users(world: Path
                                                                            ) -> None:
    tok = world / "token"
    write_token(str(tok), new_token())
    os.chown(tok, 65534, 65534)  # the unprivileged user's own file, made unreadable
    os.chmod(tok, 0)

    def read() -> None:
        read_token(str(tok))

    code, msg = as_nobody(read)
    assert code == 1, msg
    assert "another user" not in msg and "chmod 600" in msg and str(tok) in msg, msg
    os.chown(tok, 0, 0)  # root's: another user's for the unprivileged one
    os.chmod(tok, 0o600)
    code, msg = as_nobody(read)
    assert code == 1 and "another user" in msg and "uid 0" in msg, msg


def test_another_users_runtime_directory_is_named_not_a_permission_error(
        tmp_path: Path, world: Path) -> None:
    pack = str(tmp_path / "pack")
    make_dataset(str(tmp_path / "src"), files=6)
    stagefs.pack(str(tmp_path / "src"), pack, jobs=1)
    runtime = str(world / "rt")
    _map(pack, runtime, new_token())  # root's runtime directory, mode 0700

    def reader() -> None:
        stagefs.connect(runtime, timeout=60)  # nothing to wait for: refused at once

    code, msg = as_nobody(reader)
    assert code == 1, msg
    assert runtime in msg and "cannot read it" in msg and "STAGEFS_RUNTIME" in msg, msg

    def status() -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(["status", "--runtime", runtime])
        raise ClusterError(f"exit {code}: {err.getvalue()}")

    code, msg = as_nobody(status)
    assert code == 1 and "exit 1" in msg, msg
    assert "Errno" not in msg and runtime in msg and "cannot read it" in msg, msg


def test_a_reader_waits_for_the_map_of_the_new_pack_not_the_killed_daemons(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack, src = str(tmp_path / "pack"), str(tmp_path / "src")
    make_dataset(src, files=12, seed=1)
    stagefs.pack(src, pack, jobs=1)
    runtime, token = str(tmp_path / "rt"), new_token()
    _map(pack, runtime, token)  # the map a SIGKILLed daemon left
    shutil.rmtree(src)
    new = make_dataset(src, files=12, seed=2)
    stagefs.pack(src, pack, jobs=1, overwrite=True)  # the dataset made again
    tried = threading.Event()
    real = getattr(connect_mod, "_manifest_of", None)

    def manifest_of(cmap: ClusterMap, rt: str) -> Manifest:
        try:
            assert real is not None
            return real(cmap, rt)
        except ClusterError:
            tried.set()
            raise

    monkeypatch.setattr(connect_mod, "_manifest_of", manifest_of, raising=False)
    with pytest.raises(ClusterError, match="made again since this node's daemon"):
        stagefs.connect(runtime)  # no wait asked: the stale map is an error, saying why
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(_read_all(runtime, new)))
    t.start()
    assert tried.wait(60), "the reader never looked at the map"
    _map(pack, runtime, token)  # the restarted daemon writes the new pack's map
    t.join(60)
    assert got == [True]


def _read_all(runtime: str, content: dict[str, bytes]) -> bool | BaseException:
    try:
        with stagefs.connect(runtime, timeout=60) as fs:
            return all(fs.read(p) == d for p, d in content.items())
    except BaseException as exc:  # seen by the test's assert
        return exc

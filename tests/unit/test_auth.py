"""Challenge-response with the job token: proofs, refusal of a wrong token, token files."""

from __future__ import annotations

import os
import socket

import pytest

from stagefs.errors import ClusterError
from stagefs.net import auth


def test_proofs_match_only_with_the_same_token() -> None:
    tok, other = auth.new_token(), auth.new_token()
    ns, nc = auth.new_nonce(), auth.new_nonce()
    end = "10.0.0.1:7070"
    good = auth.client_proof(tok, ns, nc, end)
    assert auth.verify(auth.client_proof(tok, ns, nc, end), good)
    assert not auth.verify(auth.client_proof(other, ns, nc, end), good)
    # bound to both nonces: a proof for one connection is useless on another
    assert not auth.verify(auth.client_proof(tok, auth.new_nonce(), nc, end), good)
    assert not auth.verify(auth.client_proof(tok, ns, auth.new_nonce(), end), good)
    # and to the server end: a proof made for one daemon is useless at another
    for elsewhere in ("10.0.0.1:7071", "10.0.0.2:7070", auth.UNIX_BINDING):
        assert not auth.verify(auth.client_proof(tok, ns, nc, elsewhere), good)
        assert auth.server_proof(tok, ns, nc, elsewhere) != auth.server_proof(tok, ns, nc, end)
    # the server's proof differs from the client's (no reflection)
    assert auth.server_proof(tok, ns, nc, end) != good
    assert tok not in good


def _pair(family: int, listen: str, connect: str) -> tuple[socket.socket, socket.socket]:
    """A connected (client, accepted) pair of TCP sockets on the loopback."""
    with socket.socket(family) as lst:
        if family == socket.AF_INET6:
            lst.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        lst.bind((listen, 0))
        lst.listen(1)
        c = socket.create_connection((connect, lst.getsockname()[1]), timeout=10)
        return c, lst.accept()[0]


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(("family", "listen", "connect", "end"), [
    (socket.AF_INET, "127.0.0.1", "127.0.0.1", "127.0.0.1"),
    # a dual-stack daemon reached over IPv4 sees an IPv4-mapped address: the same end
    (socket.AF_INET6, "::", "127.0.0.1", "127.0.0.1"),
    (socket.AF_INET6, "::", "::1", "[::1]"),
])
def test_both_sides_of_a_connection_see_one_server_end(
        family: int, listen: str, connect: str, end: str) -> None:
    if family == socket.AF_INET6 and not _ipv6():
        pytest.skip("no IPv6 on this host")
    c, a = _pair(family, listen, connect)
    with c, a:
        mine = auth.channel_binding(c, accepted=False)
        assert mine == auth.channel_binding(a, accepted=True)
        assert mine == f"{end}:{c.getpeername()[1]}"
    u, v = socket.socketpair(socket.AF_UNIX)
    with u, v:
        assert auth.channel_binding(u, accepted=False) == auth.UNIX_BINDING
        assert auth.channel_binding(v, accepted=True) == auth.UNIX_BINDING


def test_token_file(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "token")
    tok = auth.new_token()
    auth.write_token(path, tok)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert auth.read_token(path) == tok
    os.chmod(path, 0o644)
    with pytest.raises(ClusterError, match="readable by others"):
        auth.read_token(path)
    os.chmod(path, 0o600)
    with open(path, "w") as f:
        f.write("zz")
    with pytest.raises(ClusterError, match="not a stagefs job token"):
        auth.read_token(path)
    with pytest.raises(ClusterError, match="no job token"):
        auth.read_token(path + ".missing")


def test_a_secret_that_is_not_a_file_is_named_as_the_secret(tmp_path: object) -> None:
    """$STAGEFS_SECRET naming a directory: an error that says it is the user's secret and
    what it must be (it was a bare "[Errno 21] Is a directory"); a secret others can read
    is called the secret, not a job token."""
    d = os.path.join(str(tmp_path), "secret")
    os.mkdir(d)
    with pytest.raises(ClusterError, match=r"user's stagefs secret .*Is a directory.*a file"):
        auth.job_token("42", d)
    path = os.path.join(str(tmp_path), "s2")
    auth.job_token("42", path)  # made on first use
    os.chmod(path, 0o644)
    with pytest.raises(ClusterError, match=r"user's stagefs secret .* readable by others"):
        auth.job_token("42", path)

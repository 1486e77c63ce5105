"""Job-token authentication: an HMAC challenge-response; the token never goes on the wire.

On connect the server sends a fresh nonce Ns. The client answers with its own nonce Nc and
``HMAC-SHA256(token, "stagefs-v2 client" || Ns || Nc || B)``; the server checks it and
answers with ``HMAC-SHA256(token, "stagefs-v2 server" || Ns || Nc || B)``, which the client
checks, so each side proves it holds the token and neither proof can be replayed on another
connection (both nonces are fresh). ``B`` (``channel_binding``) is the connection's server
end as each side sees it, the address and port the client connected to, so a proof is good
only at the daemon it was made for: a process that takes the port of a dead node (or one
taken before its daemon started) and passes a live daemon's CHALLENGE to a reader, and the
reader's AUTH back, gets a proof for its own address that the daemon refuses (protocol
version 1 had no ``B``, and that daemon took the relayed connection as proven).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat

from stagefs._fsutil import atomic_write, open_read, unreachable, user_name
from stagefs.errors import ClusterError
from stagefs.net.protocol import NONCE_SIZE
from stagefs.net.sockio import host_port

__all__ = [
    "UNIX_BINDING",
    "channel_binding",
    "client_proof",
    "job_token",
    "new_nonce",
    "new_token",
    "read_token",
    "server_proof",
    "verify",
    "write_token",
]

TOKEN_SIZE = 32
_TOKEN_FILE_MAX = 4096  # a token file is 65 bytes; what is longer is not one


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_SIZE)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


# the binding of the node fabric's Unix socket: its path is in a directory of mode 0700,
# where no other user can listen in the daemon's place, so there is nothing to relay
UNIX_BINDING = "unix"


def channel_binding(sock: socket.socket, accepted: bool) -> str:
    """The server end of the connection ``sock`` as this side sees it, which both proofs
    cover: ``accepted``: the server's accepted socket (its own address), else the client's
    connected one (its peer's). The address as an IP literal (an IPv4-mapped IPv6 address
    as its IPv4 one, an IPv6 zone left out: each node names its own interfaces), and the
    port; ``UNIX_BINDING`` on a Unix socket. A connection forwarded between the two (a
    relay, NAT, port forwarding) has two different ends, and its proofs fail."""
    if sock.family == socket.AF_UNIX:
        return UNIX_BINDING
    addr = sock.getsockname() if accepted else sock.getpeername()
    ip = ipaddress.ip_address(addr[0].partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return host_port(str(ip), addr[1])


def _mac(token: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes,
         binding: str) -> bytes:
    return hmac.new(token, label + server_nonce + client_nonce + binding.encode(),
                    hashlib.sha256).digest()


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes, binding: str) -> bytes:
    """The client's proof for the connection whose server end is ``binding``
    (``channel_binding``)."""
    return _mac(token, b"stagefs-v2 client", server_nonce, client_nonce, binding)


def server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes, binding: str) -> bytes:
    """The server's proof for the connection whose server end is ``binding``."""
    return _mac(token, b"stagefs-v2 server", server_nonce, client_nonce, binding)


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def write_token(path: str, token: bytes) -> None:
    """Write the token (hex) readable by its owner only (0600), atomically."""
    atomic_write(path, token.hex().encode() + b"\n", mode=0o600)


def job_token(job: str, secret_path: str) -> bytes:
    """The token of job ``job``, derived from the user's secret at ``secret_path`` (made on
    first use, 0600): every node of the job computes the same token from the job id alone,
    so a launcher without MPI (plain ``srun``) needs no exchange. The secret must be on a
    file system every node sees (the home directory); the tokens of two jobs differ, and
    one job's token tells nothing of another's or of the secret."""
    parent = os.path.dirname(os.path.abspath(secret_path))
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        atomic_write(secret_path, new_token().hex().encode() + b"\n", mode=0o600,
                     replace=False)  # nodes racing to make it: the first wins, all read it
    except OSError as exc:
        raise ClusterError(f"{secret_path}: cannot make the user's stagefs secret "
                           f"({exc.strerror}); set $STAGEFS_SECRET to a file in a directory "
                           "every node can write, or give --token-file") from None
    secret = read_token(secret_path, what="user's stagefs secret ($STAGEFS_SECRET, else "
                        "~/.config/stagefs/secret)")
    return hmac.new(secret, b"stagefs-v1 job " + job.encode(), hashlib.sha256).digest()


def _unreadable(path: str, st: os.stat_result | None, what: str) -> str:
    """Why this user cannot read the token file ``path`` (``st``: its stat, if that much
    worked) and what to do: its own file made unreadable (chmod) is not another user's."""
    if st is None:
        return (f"{path}: this user cannot reach the {what}: "
                f"{unreachable(path) or 'a directory on its way is not searchable'}; give a "
                "path this user can read")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.getuid():
        return (f"{path}: the {what} is not readable by its owner (mode {mode:04o}): "
                f"chmod 600 {path}")
    return (f"{path}: the {what} belongs to another user ({user_name(st.st_uid)}, mode "
            f"{mode:04o}; this is {user_name(os.getuid())}): each user's jobs have their "
            "own; use yours, or run as its owner")


def read_token(path: str, missing: str = "no job token here; is the stagefs daemon "
               "running?", what: str = "job token") -> bytes:
    """Read a token file; refuse one that others can read. ``missing``: what to say if
    there is none (a reader's runtime: the daemon may not run; a daemon's --token-file);
    ``what``: what the file is, for the messages."""
    st: os.stat_result | None = None
    try:
        st = os.stat(path)
        # without waiting, and a bounded read: a FIFO or a device (a symlink to /dev/zero)
        # where the token was would hold the reader forever or fill its memory
        fd, st = open_read(path)
        try:
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EISDIR, os.strerror(errno.EISDIR)) if stat.S_ISDIR(
                    st.st_mode) else OSError(errno.EINVAL, "not a regular file")
            text = os.pread(fd, _TOKEN_FILE_MAX, 0).strip()
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise ClusterError(f"{path}: {missing}") from None
    except PermissionError:
        raise ClusterError(_unreadable(path, st, what)) from None
    except OSError as exc:  # a directory, an I/O error: not a file to read a token from
        raise ClusterError(f"{path}: cannot read the {what} from it ({exc.strerror}): it "
                           "must be a file of its own") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterError(f"{path}: {what} readable by others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
    try:
        token = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ClusterError(f"{path}: not a stagefs {what} (expected hex)") from None
    if len(token) < 16:
        raise ClusterError(f"{path}: {what} too short ({len(token)} bytes, need 16+)")
    return token

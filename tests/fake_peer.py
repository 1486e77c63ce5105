"""A peer daemon played by a test: it listens on 127.0.0.1, answers each connection's
handshake with the job token (as a ShardServer does), then hands the connection to
``serve`` (what the test's peer does after it: hang, answer "not held", ...)."""

from __future__ import annotations

import socket
import threading

from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.sockio import recv_message


class FakePeer:
    def __init__(self, token: bytes, pack_id: bytes = b"\0" * 16) -> None:
        self.token, self.pack_id = token, pack_id
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.address = self.lst.getsockname()[:2]
        self.port = self.address[1]
        self.accepted = threading.Semaphore(0)  # one release per connection taken
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.lst.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.release()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except (OSError, ValueError, AssertionError):
            return

    def handshake(self, conn: socket.socket) -> bool:
        """The server's side of the handshake: False if the client did not prove the token."""
        ns = auth.new_nonce()
        conn.sendall(P.encode(P.Challenge(ns, self.pack_id)))
        msg = recv_message(conn, 4096)
        end = auth.channel_binding(conn, accepted=True)
        if not isinstance(msg, P.Auth) or not auth.verify(
                auth.client_proof(self.token, ns, msg.nonce, end), msg.mac):
            return False
        conn.sendall(P.encode(P.AuthOk(auth.server_proof(self.token, ns, msg.nonce, end))))
        return True

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.lst.close()
        for c in self.conns:
            c.close()


def authed(addr: tuple[str, int] | str, token: bytes) -> socket.socket:
    """A reader's connection to a real daemon that has passed the handshake (a TCP
    address, or the fabric's Unix socket path)."""
    if isinstance(addr, str):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(30)
        s.connect(addr)
    else:
        s = socket.create_connection(addr, timeout=30)
    dec = P.FrameDecoder()
    msgs: list[P.Message] = []
    while not msgs:
        dec.feed(s.recv(4096))
        msgs = dec.messages()
    ch = msgs[0]
    assert isinstance(ch, P.Challenge)
    nc = auth.new_nonce()
    s.sendall(P.encode(P.Auth(nc, auth.client_proof(token, ch.nonce, nc,
                                                    auth.channel_binding(s, accepted=False)))))
    msgs = []
    while not msgs:
        dec.feed(s.recv(4096))
        msgs = dec.messages()
    assert isinstance(msgs[0], P.AuthOk)
    return s

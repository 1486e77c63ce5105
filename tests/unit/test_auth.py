"""Challenge-response with the job token: proofs, refusal of a wrong token, token files."""

from __future__ import annotations

import os

import pytest

from stagefs.errors import ClusterError
from stagefs.net import auth


def test_proofs_match_only_with_the_same_token() -> None:
    tok, other = auth.new_token(), auth.new_token()
    ns, nc = auth.new_nonce(), auth.new_nonce()
    good = auth.client_proof(tok, ns, nc)
    assert auth.verify(auth.client_proof(tok, ns, nc), good)
    assert not auth.verify(auth.client_proof(other, ns, nc), good)
    # bound to both nonces: a proof for one connection is useless on another
    assert not auth.verify(auth.client_proof(tok, auth.new_nonce(), nc), good)
    assert not auth.verify(auth.client_proof(tok, ns, auth.new_nonce()), good)
    # the server's proof differs from the client's (no reflection)
    assert auth.server_proof(tok, ns, nc) != good
    assert tok not in good


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

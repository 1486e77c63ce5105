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

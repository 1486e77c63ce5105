"""The crafted packs of tests/data/hostile/: each is refused when it is opened, with a
CorruptManifestError that names the manifest, says what is wrong and what to do; the
readers and the CLI give that error too, and none of them hangs.

tests/hostile_packs.py made them (see its docstring); its base pack, unchanged, opens and
reads, so each case is refused for what its mutation did."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

import stagefs
from hostile_packs import CASES, FILES, LINKS, run_bounded, write_base_pack
from stagefs.cli import main
from stagefs.errors import CorruptManifestError, FormatError, StagefsError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.verify import verify_pack

CORPUS = Path(__file__).parent.parent / "data" / "hostile"
LIMIT = 60.0  # seconds before a reader counts as hung: far above any real run of one


def test_every_case_is_checked_in() -> None:
    assert sorted(p.name for p in CORPUS.iterdir()) == sorted(CASES)


def test_the_base_pack_reads(tmp_path: Path) -> None:
    write_base_pack(str(tmp_path))
    with stagefs.open(tmp_path) as fs:
        for path, data in FILES.items():
            assert fs.read(path) == data
        for path, (target, _) in LINKS.items():
            assert os.fsencode(fs.readlink(path)) == target
        assert fs.read("img/up") == FILES[b"ab/f1.txt"]
    assert verify_pack(str(tmp_path), jobs=1, progress=False).ok


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_manifest_is_refused_at_open(case: str) -> None:
    where = str(CORPUS / case / MANIFEST_NAME)
    out = run_bounded(lambda: Manifest(where).close(), LIMIT)
    assert out.error == "CorruptManifestError", out
    fragment = CASES[case][1]
    assert where in out.message and fragment in out.message, out.message
    assert "re-pack the dataset" in out.message


@pytest.mark.parametrize("case", sorted(CASES))
def test_readers_and_cli_give_the_error(case: str) -> None:
    """Through the API and the CLI: the same error, never a hang or a traceback."""
    pack = str(CORPUS / case)

    def readers() -> list[str]:
        seen = []
        for path in ("nope", "a.txt", "img/up"):  # "nope" first: a full table hung it
            with pytest.raises(CorruptManifestError) as info, stagefs.open(pack) as fs:
                fs.stat(path)
                fs.read(path)
            seen.append(str(info.value))
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            codes = [main(["stat", pack, "nope"]), main(["ls", pack]),
                     main(["cat", pack, "a.txt"])]
        assert codes == [1, 1, 1]
        seen.append(err.getvalue())
        return seen

    out = run_bounded(readers, LIMIT)
    assert out.error is None, out
    for message in out.value:
        assert pack in message and "corrupt manifest" in message


def test_errors_are_format_errors() -> None:
    assert issubclass(CorruptManifestError, FormatError)
    assert issubclass(CorruptManifestError, StagefsError)

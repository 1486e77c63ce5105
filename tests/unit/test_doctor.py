"""``stagefs doctor``'s network check: the send buffer the node daemon asks for its readers'
connections against the kernel's cap, read from a file as /proc gives it."""

from __future__ import annotations

from pathlib import Path

from stagefs.doctor import check_network
from stagefs.net.server import UNIX_SNDBUF


def test_a_cap_that_fits_a_reply_is_ok(tmp_path: Path) -> None:
    f = tmp_path / "wmem_max"
    f.write_text(f"{UNIX_SNDBUF}\n")
    [finding] = check_network(str(f))
    assert finding.status == "ok" and "4.0 MiB" in finding.meaning


def test_the_usual_cap_is_a_warning_that_says_what_to_set(tmp_path: Path) -> None:
    f = tmp_path / "wmem_max"
    f.write_text("212992\n")
    [finding] = check_network(str(f))
    assert finding.status == "warn"
    assert "208.0 KiB" in finding.meaning
    assert f"sysctl -w net.core.wmem_max={UNIX_SNDBUF}" in finding.meaning


def test_an_unreadable_cap_is_a_warning_not_an_error(tmp_path: Path) -> None:
    for content in (None, "junk"):
        f = tmp_path / "wmem_max"
        if content is None:
            f.unlink(missing_ok=True)
        else:
            f.write_text(content)
        [finding] = check_network(str(f))
        assert finding.status == "warn" and str(f) in finding.meaning

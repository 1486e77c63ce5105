"""The FUSE mount's record of what it handed the kernel (posix/fuse.py, ``Served``): each
small file counted once, whether the pusher put it in the page cache or a READ asked."""

from __future__ import annotations

from stagefs.posix.fuse import Served


def test_a_pushed_file_read_later_is_counted_once() -> None:
    s = Served(4)
    assert s.claim(1)
    assert s.read(1) is False  # the kernel asked before the push landed: counted by the push
    assert s.read(1) is True  # a later READ (the page dropped meanwhile) is a new sample
    assert not s.claim(1)  # and is never pushed again


def test_a_read_of_a_file_pushed_before_is_a_new_read() -> None:
    """The kernel let go of a pushed file's pages and the program reads it again (the next
    epoch): counted (it never was: a later epoch of pushed files counted nothing)."""
    s = Served(4)
    assert s.claim(0)
    s.pushed(0)  # the push landed and was counted
    assert s.read(0) is True
    assert s.read(0) is True
    assert not s.claim(0)


def test_a_file_read_first_is_not_pushed() -> None:
    s = Served(4)
    assert s.read(2) is True
    assert not s.claim(2)


def test_a_failed_push_leaves_the_file_to_be_counted_by_its_read() -> None:
    s = Served(4)
    assert s.claim(3)
    s.unclaim(3)
    assert s.read(3) is True
    s.unclaim(3)  # after a read: nothing to undo
    assert not s.claim(3)

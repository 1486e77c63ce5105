"""A peer's health, one rule for every way of reaching a peer (TCP: ``PeerClient``,
net/client.py; MPI: ``MpiPeer``, cluster/mpi_transport.py).

A peer that failed, or that a hedged read found slow, is *suspect*: reads skip it at once
(the next holder answers) until a probe in the background, never the caller, finds it
answering again. The first probe comes ``backoff[0]`` seconds after the failure; each failure
while suspect doubles the wait, up to ``backoff[1]``; an answer clears both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["BACKOFF", "PeerHealth"]

log = logging.getLogger("stagefs.health")

BACKOFF = (0.5, 30.0)  # a suspect peer is probed again after this long, doubling


def _nothing() -> None:
    return None


class PeerHealth:
    """Whether one peer is suspect, and when it is probed again.

    ``probe`` asks the peer (True if it answered, having called ``answered``); it runs in a
    thread of its own, one at a time. ``clock``: seconds, monotonic (injected in tests).
    ``lock``: the lock to take for a change of state (a client's pool lock, so that
    ``on_suspect``, called under it, can wake the requests that wait on the pool)."""

    def __init__(self, name: str, probe: Callable[[], bool], clock: Callable[[], float], *,
                 backoff: tuple[float, float] = BACKOFF, lock: threading.Lock | None = None,
                 on_suspect: Callable[[], None] = _nothing, thread_name: str = "") -> None:
        self.name = name
        self.clock = clock
        self.backoff_range = backoff
        self.answered_at = float("-inf")  # the last answer: a peer that answers is alive
        self.retry_at: float | None = None  # suspect until then, and probed after it
        self._probe = probe
        self._lock = lock or threading.Lock()
        self._on_suspect = on_suspect
        self._backoff = backoff[0]
        self._prober: threading.Thread | None = None
        self._thread_name = thread_name or f"stagefs-probe-{name}"

    def suspect(self) -> bool:
        """True while the peer is suspect: skip it. Once its back-off has passed, a probe
        starts in the background."""
        retry_at = self.retry_at
        if retry_at is None:
            return False
        if self.clock() >= retry_at:
            self._start_probe()
        return True

    def is_suspect(self) -> bool:
        """Suspect now, without starting a probe (for status reports)."""
        return self.retry_at is not None

    def mark_suspect(self, why: str) -> None:
        """Skip the peer until it answers again (a hedged read found it slow); the back-off
        does not grow."""
        with self._lock:
            if self.retry_at is not None:
                return
            self.retry_at = self.clock() + self._backoff
            self._on_suspect()
        log.info("%s: %s; suspect until it answers again", self.name, why)

    def failed(self, why: object) -> None:
        """A request failed: the peer is suspect, probed again after the back-off, which
        doubles for the next failure."""
        with self._lock:
            self.retry_at = self.clock() + self._backoff
            wait = self._backoff
            self._backoff = min(self._backoff * 2, self.backoff_range[1])
            self._on_suspect()
        log.info("%s: %s; skipped, probed again in %g s", self.name, why, wait)

    def answered(self) -> None:
        """The peer answered: no longer suspect, its back-off back to the first."""
        self.answered_at = self.clock()
        if self.retry_at is not None or self._backoff != self.backoff_range[0]:
            with self._lock:
                if self.retry_at is not None:
                    log.info("%s: answers again", self.name)
                self.retry_at = None
                self._backoff = self.backoff_range[0]

    def wait_probe(self, timeout: float | None = None) -> None:
        """Wait for the background probe, if one is running."""
        prober = self._prober
        if prober is not None:
            prober.join(timeout)

    def _start_probe(self) -> None:
        with self._lock:
            if self._prober is not None and self._prober.is_alive():
                return
            self._prober = threading.Thread(target=self._probe, daemon=True,
                                            name=self._thread_name)
            self._prober.start()

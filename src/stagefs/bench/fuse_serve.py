"""The FUSE server ``stagefs bench`` measures: what ``stagefs mount --foreground`` runs
(``stagefs.posix.fuse.mount`` of a Store), plus a thread that writes the store's origin
counters to a file every 50 ms so the reading process can take them before and after each
epoch.

``python -m stagefs.bench.fuse_serve PACK MOUNTPOINT STATS_FILE [RUNTIME TIER...]``
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from stagefs._fsutil import atomic_write


def _publish(store: Any, path: str, stop: threading.Event) -> None:
    """Every tick, even with nothing new: ``at`` (the system-wide monotonic clock) tells the
    reader that these counters were taken after its epoch ended, however late this thread
    ran on a loaded machine."""
    while not stop.wait(0.05):
        now = {**store.origin.stats.as_dict(), "at": time.monotonic()}
        atomic_write(path, json.dumps(now), fsync=False)


def main(argv: list[str]) -> int:
    import stagefs
    from stagefs.posix import fuse

    pack, mountpoint, stats_file, *rest = argv
    store = stagefs.open(pack, tiers=rest[1:], runtime=rest[0]) if rest else stagefs.open(pack)
    stop = threading.Event()
    t = threading.Thread(target=_publish, args=(store, stats_file, stop), daemon=True)
    t.start()
    try:
        fuse.mount(store, mountpoint)
    finally:
        stop.set()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The process that converts for, or reads through, one system: ``python -m
stagefs.bench.worker SPEC.json OUT.json``. The runner starts one per system and run, so each
epoch's peak memory and CPU belong to the system alone, and the peers can run in their own
Python (their own numpy) while stagefs runs in this one.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from stagefs._fsutil import atomic_write
from stagefs.bench.measure import EpochFigures, OriginCounter, Proc, Tally


def _system(name: str) -> Any:
    from stagefs.bench.systems import all_systems

    for s in all_systems():
        if s.name == name:
            return s
    raise SystemExit(f"unknown system {name!r}")


def _convert(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    system = _system(spec["system"])
    t0 = time.perf_counter()
    where = system.convert(ctx)
    return {"seconds": time.perf_counter() - t0, "dir": where}


def _epochs(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    system = _system(spec["system"])
    run, roots = spec["run"], tuple(os.path.join(r, "") for r in spec["origin_roots"])
    with open(spec["sizes"]) as f:
        sizes: dict[str, int] = json.load(f)
    me = Proc()
    server = Proc(spec["server_pid"]) if spec.get("server_pid") else None
    out: list[dict[str, Any]] = []
    with OriginCounter(roots, sizes) as counter:
        t0 = time.perf_counter()
        system.open(ctx, run)
        setup = time.perf_counter() - t0
        try:
            for epoch in range(spec["epochs"]):
                out.append(_one_epoch(system, ctx, spec, epoch, counter, me, server, roots,
                                      setup if epoch == 0 else 0.0).as_dict())
        finally:
            system.close()
    return {"epochs": out}


def _one_epoch(system: Any, ctx: Any, spec: dict[str, Any], epoch: int,
               counter: OriginCounter, me: Proc, server: Proc | None,
               roots: tuple[str, ...], setup: float) -> EpochFigures:
    """One measured epoch. The first one also carries the setup's origin operations."""
    if epoch == 0:
        opens0, stats0, bytes0 = 0, 0, 0  # the counter started before setup
    else:
        opens0, stats0, bytes0 = counter.snapshot()
    own0 = system.origin_bytes()
    io0, cpu0 = me.io(), me.cpu()
    s_cpu0 = server.cpu() if server else 0.0
    s_stats0 = _server_stats(spec) if server and epoch else {}
    me.reset_peak()
    if server:
        server.reset_peak()
    tally = Tally()
    t0 = time.perf_counter()
    tally.consume(system.epoch(ctx, spec["run"], epoch))
    seconds = time.perf_counter() - t0
    cpu = me.cpu() - cpu0
    io1 = me.io()
    opens1, stats1, bytes1 = counter.snapshot()
    own1 = system.origin_bytes()
    origin_bytes = bytes1 - bytes0 if own1 is None else own1 - (own0 or 0)
    peak, shared = me.peak_rss(), me.shared_rss()
    extra: dict[str, Any] = {}
    opens = opens1 - opens0
    if server:  # FUSE: the server process reads the origin; count its share too
        cpu += server.cpu() - s_cpu0
        s_stats1 = _server_stats(spec, after=time.monotonic())
        origin_bytes = int(s_stats1.get("bytes_read", 0) - s_stats0.get("bytes_read", 0))
        opens += int(s_stats1.get("opens", 0) - s_stats0.get("opens", 0))
        stats_extra = int(s_stats1.get("stats", 0) - s_stats0.get("stats", 0))
        extra["server_peak_rss"] = server.peak_rss()
        peak += extra["server_peak_rss"]
        shared += server.shared_rss()
        stats1 += stats_extra
    checksum, distinct = tally.digest()
    return EpochFigures(
        system=system.name, run=spec["run"], epoch=epoch, cold=bool(spec["cold"]) and epoch == 0,
        seconds=seconds, samples=tally.samples, bytes=tally.bytes, distinct=distinct,
        checksum=checksum, cpu_seconds=cpu, peak_rss=peak, shared_rss=shared,
        origin_opens=max(0, opens),
        origin_stats=stats1 - stats0, origin_bytes=max(0, origin_bytes),
        rchar=io1.get("rchar", 0) - io0.get("rchar", 0),
        read_bytes=io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
        setup_seconds=setup, extra=extra)


def _server_stats(spec: dict[str, Any], after: float | None = None,
                  timeout: float = 30.0) -> dict[str, float]:
    """The FUSE server's origin counters (fuse_serve.py writes them every 50 ms). With
    ``after``: the first ones taken after that moment (their ``at``), so that an epoch's
    bytes are never counted in the next one's when the server's thread runs late; the
    last seen if none comes within ``timeout`` (a server that died)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(spec["server_stats"]) as f:
                stats = dict(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            stats = {}
        if after is None or stats.get("at", 0.0) >= after or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    from stagefs.bench.base import Context

    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    ctx = Context(**spec["ctx"])
    try:
        if spec["op"] == "probe":
            result: dict[str, Any] = {"missing": _system(spec["system"]).missing()}
        elif spec["op"] == "convert":
            result = _convert(spec, ctx)
        else:
            result = _epochs(spec, ctx)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    atomic_write(out_path, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

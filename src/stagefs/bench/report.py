"""The outputs of ``stagefs bench``: results.json (every figure), table.md, and PNG plots
(with the optional ``plot`` extra: matplotlib)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from stagefs._table import table

__all__ = ["limit_table", "origin_limit", "summarize", "summary_table", "write_report"]

PLOTS = ("throughput.png", "epochs.png", "origin_ops.png")  # what _plots may write
HEADERS = ["system", "conversion s", "size on disk MB", "cold samples/s", "warm samples/s",
           "warm MB/s", "origin opens (cold)", "origin stats (cold)", "origin MB (cold)",
           "origin opens (warm)", "peak RSS MiB", "of which shared MiB", "CPU s / 1k samples",
           "all once, same bytes"]


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _median_or_none(epochs: Sequence[dict[str, Any]], key: str) -> float | None:
    return _median([e[key] for e in epochs]) if epochs else None


def _names(results: dict[str, Any]) -> list[str]:
    """The systems in the order they ran, then those that never ran (a failed conversion)."""
    order = list(results.get("order") or [])
    return order + [n for n in results["systems"] if n not in order]


def summarize(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: medians over runs (cold = the first epoch of each run; warm = the others).
    ``failed_runs``: the runs that failed (their error in ``results``), left out of them."""
    out: dict[str, dict[str, Any]] = {}
    for name in _names(results):
        s = results["systems"][name]
        eps = s["epochs"]
        if not eps:
            why = ("not run: stopped by Ctrl-C before its turn" if results.get("interrupted")
                   else "no epochs")  # a system Ctrl-C stopped first did not fail
            out[name] = {"title": s["title"], "error": (s["errors"] or [why])[0]}
            continue
        first = [e for e in eps if e["epoch"] == 0]
        # with --epochs 1 there is no warm epoch: its figures are None ("-"), never the
        # cold epoch's again under a warm heading
        rest = [e for e in eps if e["epoch"] > 0]
        per_epoch = [
            _median([e["samples_per_s"] for e in eps if e["epoch"] == k])
            for k in range(max(e["epoch"] for e in eps) + 1)]
        out[name] = {
            "title": s["title"],
            "conversion_s": s["conversion"]["seconds"],
            "size_on_disk": s["conversion"]["bytes_on_disk"],
            "cold_samples_per_s": _median([e["samples_per_s"] for e in first]),
            "warm_samples_per_s": _median_or_none(rest, "samples_per_s"),
            "warm_mb_per_s": _median_or_none(rest, "mb_per_s"),
            "cold_origin_opens": _median([e["origin_opens"] for e in first]),
            "cold_origin_stats": _median([e["origin_stats"] for e in first]),
            "cold_origin_bytes": _median([e["origin_bytes"] for e in first]),
            "warm_origin_opens": _median_or_none(rest, "origin_opens"),
            "warm_origin_stats": _median_or_none(rest, "origin_stats"),
            "warm_origin_bytes": _median_or_none(rest, "origin_bytes"),
            "peak_rss": max(e["peak_rss"] for e in eps),
            "peak_shared_rss": max(e.get("shared_rss", 0) for e in eps),
            "cpu_s_per_1k": _median([e["cpu_s_per_1k"] for e in eps]),
            "per_epoch_samples_per_s": per_epoch,
            "ok": bool(s.get("all_samples_once")) and bool(s.get("same_bytes")),
            "failed_runs": len(s["errors"]),
        }
    return out


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def summary_table(results: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    for name, m in summarize(results).items():
        if "error" in m:
            rows.append([name, "error: " + m["error"].splitlines()[0][:60]]
                        + ["-"] * (len(HEADERS) - 2))
            continue
        rows.append([
            name, _fmt(m["conversion_s"], 2), _fmt(m["size_on_disk"] / 1e6, 1),
            _fmt(m["cold_samples_per_s"]), _fmt(m["warm_samples_per_s"]),
            _fmt(m["warm_mb_per_s"]), _fmt(m["cold_origin_opens"]),
            _fmt(m["cold_origin_stats"]), _fmt(m["cold_origin_bytes"] / 1e6, 1),
            _fmt(m["warm_origin_opens"]), _fmt(m["peak_rss"] / 2**20),
            _fmt(m["peak_shared_rss"] / 2**20),
            _fmt(m["cpu_s_per_1k"], 3), ("yes" if m["ok"] else "NO") + (
                f"; {m['failed_runs']} of {results['runs']} runs failed"
                if m.get("failed_runs") else "")])
    return table(HEADERS, rows)


def _settings(results: dict[str, Any]) -> str:
    systems = results["systems"]
    lines = [f"- **{n}** ({systems[n]['title']}): {systems[n]['settings']}"
             for n in _names(results)]
    lines += [f"- {n}: left out: {why.splitlines()[0]}" for n, why in results["skipped"].items()]
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    d = results["dataset"]
    head = (f"{d['files']:,} {d['kind']} files, {d['bytes'] / 1e6:,.1f} MB at {d['root']}; "
            f"{results['epochs']} epochs per run, {results['runs']} runs, medians; "
            f"first epoch of each run cold ({results['cold']})"
            + ("; one epoch a run, so no warm figures." if results["epochs"] == 1 else "."))
    cmd = f"\n\nCommand: `{results['command']}`" if results.get("command") else ""
    if results.get("interrupted"):
        head = f"**Incomplete: {results['interrupted']}.** " + head
    load = results.get("load_average", {})
    if load:
        cmd += (f"\n\nLoad average (1 min) at start {load['start'][0]:.1f}, at end "
                f"{load['end'][0]:.1f}, on {results['machine']['cpus']} CPUs.")
    return (f"{head}{cmd}\n\n{summary_table(results)}\n{limit_table(results)}\nSettings:\n\n"
            f"{_settings(results)}\n")


def origin_limit(results: dict[str, Any]) -> dict[str, float]:
    """Median samples/s of the origin's sequential limit, per pass ("1 stream", "6 streams",
    "6 streams kept": bench/limit.py's ``label``)."""
    from stagefs.bench.limit import label

    passes = results.get("origin_limit") or []
    labels = sorted({label(p) for p in passes},
                    key=lambda k: (k.endswith("kept"), int(k.split()[0])))
    return {k: _median([p["samples_per_s"] for p in passes if label(p) == k]) for k in labels}


def limit_table(results: dict[str, Any]) -> str:
    """Each system's cold epoch against the origin's sequential limit (bench/limit.py)."""
    from stagefs.bench.limit import label

    limits = origin_limit(results)
    if not limits:
        return ""
    passes = results["origin_limit"]
    mb = {k: _median([p["mb_per_s"] for p in passes if label(p) == k]) for k in limits}
    best = max(v for k, v in limits.items() if not k.endswith("kept"))
    # dropped only when every pass dropped it: else the limit may be the page cache's
    cache = ("page cache dropped" if all(p.get("cold") for p in passes) else
             "page cache NOT dropped, so the limit may be memory's, not the origin's")
    read = [k for k in limits if not k.endswith("kept")]
    kept = [k for k in limits if k.endswith("kept")]
    head = ("\nThe origin's sequential limit (the pack's shard files read whole, 4 MiB a "
            f"read, {cache}): " + ", ".join(
                f"{k} {mb[k]:,.0f} MB/s = {limits[k]:,.0f} samples/s" for k in read) + "."
            + "".join(f" Read by {k.split()[0]} streams that also write what they read into "
                      f"node-local storage (the least a loader that keeps the data does): "
                      f"{mb[k]:,.0f} MB/s = {limits[k]:,.0f} samples/s ({k})." for k in kept)
            + "\n\n")
    rows: list[list[object]] = []
    for name, m in summarize(results).items():
        if "error" in m or not results["systems"][name].get("on_origin", True):
            continue
        cold = m["cold_samples_per_s"]
        row: list[object] = [name, _fmt(cold)]
        row += [_fmt(cold / v, 2) if v else "-" for v in limits.values()]
        rows.append([*row, _fmt(cold / best, 2) if best else "-"])
    headers = ["system", "cold samples/s"] + [f"/ {k}" for k in limits] + ["/ best"]
    return head + table(headers, rows) + "\n"


def write_report(results: dict[str, Any], out: str) -> list[str]:
    """Write results.json, table.md and the plots; return the paths written."""
    os.makedirs(out, exist_ok=True)
    for name in PLOTS:  # an earlier run's plots would pass for this run's
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out, name))
    results["summary"] = summarize(results)
    paths = [os.path.join(out, "results.json"), os.path.join(out, "table.md")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    with open(paths[1], "w") as f:
        f.write(markdown(results))
    try:
        paths += _plots(results, out)
    except ImportError:
        print("stagefs bench: matplotlib is not installed, so no plots "
              "(pip install 'stagefs[plot]'); results.json and table.md are written")
    return paths


def _plots(results: dict[str, Any], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = {n: m for n, m in results["summary"].items() if "error" not in m}
    names = list(summary)
    if not names:
        return []
    paths = []
    ys = range(len(names))

    # --epochs 1 has no warm epoch: its panel and bars are left out, not drawn as zeros
    warm = any(summary[n]["warm_samples_per_s"] is not None for n in names)
    panels = [("cold_samples_per_s", "cold first epoch")]
    panels += [("warm_samples_per_s", "warm epochs")] if warm else []
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 0.5,
                                                      0.45 * len(names) + 1.5),
                             sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (key, label) in zip(axes, panels, strict=True):
        vals = [summary[n][key] or 0.0 for n in names]
        # a node-local copy is never cold: keep the cold scale for the systems that are
        local = {n for n in names if not results["systems"][n].get("on_origin", True)}
        scale = max([v for n, v in zip(names, vals, strict=True)
                     if key.startswith("warm") or n not in local] or vals)
        top = scale * 1.25 or 1.0
        ax.barh(list(ys), [min(v, top) for v in vals],
                color=["C1" if n.startswith("stagefs") else "C0" for n in names])
        for y, v in zip(ys, vals, strict=True):
            ax.text(min(v, top * 0.8), y, f" {v:,.0f}" + (" (local copy)" if v > top else ""),
                    va="center", fontsize=8)
        ax.set_xlabel(f"samples/s, {label} (median over runs)")
        ax.set_xlim(0, top)
    axes[0].set_yticks(list(ys), names)
    axes[0].invert_yaxis()
    fig.suptitle("Shuffled-epoch throughput per system")
    paths.append(_save(fig, out, "throughput.png"))

    epochs = max(len(summary[n]["per_epoch_samples_per_s"]) for n in names)
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 4.5))
    width = 0.8 / epochs
    for k in range(epochs):
        vals = [(summary[n]["per_epoch_samples_per_s"] + [0] * epochs)[k] for n in names]
        ax.bar([x + k * width for x in range(len(names))], vals, width=width,
               label=f"epoch {k + 1}" + (" (cold)" if k == 0 else ""))
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=30,
                  ha="right")
    ax.set_ylabel("samples/s (median over runs)")
    ax.legend()
    ax.set_title("Per-epoch throughput")
    paths.append(_save(fig, out, "epochs.png"))

    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    bars = [("cold epoch", [summary[n]["cold_origin_opens"] + summary[n]["cold_origin_stats"]
                            for n in names])]
    bars += [("warm epoch", [(summary[n]["warm_origin_opens"] or 0)
                             + (summary[n].get("warm_origin_stats") or 0) for n in names])
             ] if warm else []
    for off, (label, ops) in zip((-0.2, 0.2) if warm else (0.0,), bars, strict=True):
        ax.barh([y + off for y in ys], [max(0.8, v) for v in ops], height=0.4, label=label)
        for y, v in zip(ys, ops, strict=True):
            ax.text(max(0.8, v), y + off, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("path operations on the origin per epoch (opens + stats; median; log)")
    ax.legend(loc="lower right")
    ax.set_title("Metadata load on the origin")
    paths.append(_save(fig, out, "origin_ops.png"))
    return paths


def _save(fig: Any, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

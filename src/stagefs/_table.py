"""Plain-text tables for the terminal (and markdown, which is the same text)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table whose columns line up; numbers are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(_is_num(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric,
                                                                         strict=True)]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                         for w, num in zip(widths, numeric, strict=True)) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _is_num(s: str) -> bool:
    s = s.replace(",", "").rstrip("x%").lstrip("x")
    try:
        float(s)
    except ValueError:
        return False
    return True

"""Plain-text tables for the command-line tools and benchmarks."""

from __future__ import annotations


def format_table(rows: list[dict], columns: list[tuple[str, str]], name: str = "plan") -> str:
    """Plain-text table: columns are (key, format) pairs; the first column is the row ``name``."""
    head = [name] + [k for k, _ in columns]
    body = [[r["name"]] + [format(r[k], f) for k, f in columns] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in body])


METRIC_COLUMNS = [
    ("dbr", ".4f"),
    ("abr", ".4f"),
    ("pr", ".4f"),
    ("cr", ".3f"),
    ("ave_t", ".0f"),
    ("fill", ".5f"),
    ("n_steps", "d"),
    ("n_packs", "d"),
    ("seconds", ".3f"),
]

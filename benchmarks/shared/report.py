"""A benchmark's results: a printed table, a JSON file and a PNG chart in the results folder.

Every figure that comes from repeated runs is kept as a spread: its median, min, max and runs.
A quick run (`--quick`: a tiny random-weight model, a small workload, two runs) says nothing about
speed, so each of its tables, its JSON and its chart says it is one, and it reports no speed ratio:
"2.22x vs best peer" from a quick run would read as a result.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PEERS = ("transformers", "llama.cpp")  # labels of the peers' configurations start so
QUICK_TAG = "[quick run]"
QUICK_NOTICE = ("QUICK RUN (--quick): a tiny random-weight model on a small workload; it checks "
                "that the code runs and measures nothing. Speed ratios are left out.")


def spread(runs: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the runs themselves."""
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs),
            "runs": list(runs)}


def fmt(s: dict[str, Any], digits: int = 1) -> str:
    """'12.3 [11.9-12.8]': the median and the range of the runs (the median alone for one run)."""
    if len(s["runs"]) == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


class Report:
    """Collects a benchmark's tables and data, prints each table as it comes, writes the files."""

    def __init__(self, name: str, machine: dict, settings: dict) -> None:
        self.name = name
        self.quick = bool(settings.get("quick"))
        self.data: dict[str, Any] = {"benchmark": name, "machine": machine,
                                     "settings": settings, "tables": []}
        if self.quick:
            self.data.update(quick=True, notice=QUICK_NOTICE)
            print(f"\n{QUICK_NOTICE}")

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
              note: str = "") -> None:
        if self.quick:
            title = f"{QUICK_TAG} {title}"
        cells = [[str(c) for c in columns]] + [[str(c) for c in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        print(f"\n{title}")
        for i, row in enumerate(cells):
            first, *rest = row
            print("  " + first.ljust(widths[0]) + "".join(
                "  " + c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)))
            if i == 0:
                print("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))
        if note:
            print(textwrap.fill(note, 98, initial_indent="  ", subsequent_indent="  "))
        self.data["tables"].append({"title": title, "columns": list(columns),
                                    "rows": cells[1:], "note": note})

    def ratios(self, title: str, ratios: dict[str, float]) -> None:
        """Same-run speed ratios: a table and data["ratios"]; none from a quick run."""
        if self.quick:
            print(f"\n{QUICK_TAG} {title}: left out")
            return
        self.table(title, ["ratio", "x"], [[k, f"{v:.2f}"] for k, v in ratios.items()])
        self.data["ratios"] = ratios

    def save(self, folder: str | Path, draw: Callable[[Any], None]) -> tuple[Path, Path]:
        """Writes <name>.json and <name>.png (draw(figure) fills the chart) into folder."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        json_path, png_path = folder / f"{self.name}.json", folder / f"{self.name}.png"
        json_path.write_text(json.dumps(self.data, indent=1) + "\n")
        figure = plt.figure(figsize=(10, 4.5))
        draw(figure)
        m = self.data["machine"]
        quick = "QUICK RUN, not a measurement: " if self.quick else ""
        figure.suptitle(f"{quick}batchwire bench {self.name}: {m['cpu']}, {m['cores']} cores, "
                        f"torch {m['torch']}, {m['dtype']}, {m['torch_threads']} threads",
                        fontsize=9, color="tab:red" if self.quick else "black")
        if self.quick:  # across the bars too, so that a cropped chart still says it
            figure.text(0.5, 0.5, "QUICK RUN", fontsize=60, color="tab:red", alpha=0.15,
                        ha="center", va="center", rotation=20)
        figure.tight_layout()
        figure.savefig(png_path, dpi=100)
        plt.close(figure)
        print(f"\nwrote {json_path} and {png_path}")
        return json_path, png_path


def bars(ax: Any, labels: Sequence[str], stats: Sequence[dict[str, Any]], ylabel: str) -> None:
    """Median bars with min-max whiskers; batchwire's blue, its peers' grey."""
    medians = [s["median"] for s in stats]
    low = [s["median"] - s["min"] for s in stats]
    high = [s["max"] - s["median"] for s in stats]
    ax.bar(range(len(labels)), medians, yerr=[low, high], capsize=4,
           color=["tab:gray" if x.startswith(PEERS) else "tab:blue" for x in labels])
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)

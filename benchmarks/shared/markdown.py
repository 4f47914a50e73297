"""Prints the tables of a results folder's JSON files as Markdown, for docs/performance.md:

    .venv/bin/python -m batchwire.benchmarks.shared.markdown bench-results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def to_markdown(data: dict) -> str:
    m = data["machine"]
    lines = [f"_{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['dtype']}, "
             f"{m['torch_threads']} torch thread(s), 1-minute load average {m['load_average_1m']} "
             f"when the run ended, {m['time']}_", ""]
    for table in data["tables"]:
        lines += [f"**{table['title']}**", "", "| " + " | ".join(table["columns"]) + " |",
                  "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
        lines += ["", table["note"], ""] if table["note"] else [""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    folder = Path(argv[0] if argv else "bench-results")
    for path in sorted(folder.glob("*.json")):
        print(f"### {path.stem}\n\n{to_markdown(json.loads(path.read_text()))}")


if __name__ == "__main__":
    main(sys.argv[1:])

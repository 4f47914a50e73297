"""A quick run's report says it is one, in its tables, its JSON and its chart, and carries no speed
ratio; a full run's report is unchanged. (test_bench_quick.py checks the same on every benchmark
end to end, in one slow run.)"""

from __future__ import annotations

import json

from batchwire.benchmarks.shared.report import QUICK_NOTICE, Report, bars, spread

MACHINE = {"cpu": "test cpu", "cores": 2, "torch": "2.13.0", "dtype": "float32",
           "torch_threads": 1}


def report_of(tmp_path, quick: bool) -> tuple[dict, list[str]]:
    """(the JSON written, the chart's texts)."""
    report = Report("demo", MACHINE, {"quick": quick, "repeats": 2})
    report.table("tokens/s", ["configuration", "tok/s"], [["batchwire uni", "12.0"]])
    report.ratios("same-run ratios (medians)", {"uni / transformers": 2.22})
    figures = []

    def draw(figure):
        figures.append(figure)
        bars(figure.add_subplot(1, 1, 1), ["batchwire uni"], [spread([11.0, 13.0])], "tok/s")

    json_path, png_path = report.save(tmp_path / ("quick" if quick else "full"), draw)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figure = figures[0]
    return json.loads(json_path.read_text()), sorted(t.get_text() for t in figure.texts)


def test_a_quick_run_is_labelled_and_has_no_ratios(tmp_path, capsys):
    data, chart = report_of(tmp_path, quick=True)
    out = capsys.readouterr().out
    assert data["quick"] is True and data["notice"] == QUICK_NOTICE
    assert "ratios" not in data
    assert [t["title"] for t in data["tables"]] == ["[quick run] tokens/s"]
    assert chart == ["QUICK RUN", "QUICK RUN, not a measurement: batchwire bench demo: test cpu, "
                     "2 cores, torch 2.13.0, float32, 1 threads"]  # the title, and across the bars
    assert QUICK_NOTICE in out and "[quick run] tokens/s" in out
    assert "2.22" not in out and "[quick run] same-run ratios (medians): left out" in out


def test_a_full_run_keeps_its_ratios(tmp_path, capsys):
    data, chart = report_of(tmp_path, quick=False)
    out = capsys.readouterr().out
    assert "quick" not in data and data["ratios"] == {"uni / transformers": 2.22}
    assert [t["title"] for t in data["tables"]] == ["tokens/s", "same-run ratios (medians)"]
    assert chart == ["batchwire bench demo: test cpu, 2 cores, torch 2.13.0, float32, 1 threads"]
    assert "2.22" in out and "QUICK" not in out

"""The committed ``benchmarks/results/README.md`` is the index ``benchmarks.results_index``
generates from the reports beside it, and every file there belongs to a listed report."""

from __future__ import annotations

from benchmarks.results_index import INDEX, RESULTS, render, rows


def test_committed_index_is_current() -> None:
    assert INDEX.read_text() == render(), (
        "benchmarks/results/README.md is stale: run python -m benchmarks.results_index"
    )


def test_every_results_file_is_a_report_or_belongs_to_one() -> None:
    listed = {"README.md", "gpu_README.md"}
    for row in rows():
        listed.add(row["file"])
        listed.update(filter(None, row["companions"].split(", ")))
    stray = sorted(p.name for p in RESULTS.iterdir() if p.name not in listed)
    assert not stray, f"files no report claims (name them <benchmark>_<device>_<date>): {stray}"

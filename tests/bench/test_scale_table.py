"""`metalog bench --scale`'s figures table (tools/bench/scale.py): goals turn
into pass/fail rows, and the marked section of the docs file is replaced,
appended, or (markers broken) refused with the file left as it was."""

from __future__ import annotations

import pytest

from metalog.tools.bench import catchup
from metalog.tools.bench.scale import (SECTION_BEGIN, SECTION_END, Row, SectionError, render_section, replace_section,
                               rows_from, write_docs)
from metalog.storage import batch as b


def snapshot_figures(**over) -> dict:
    fig = {"load_seconds": 1.5, "replay_seconds": 9.0, "replay_over_load": 6.0, "replay_records_per_s": 450_000.0,
           "fresh_load": {"seconds": 1.25, "cpu_seconds": 1.2, "rss_mib": 430.0, "peak_rss_mib": 440.0},
           "reads": {"one topic (configs + up to 1000 partitions)": {"p50_ms": 0.3, "p99_ms": 2.0, "max_ms": 9.0},
                     "one broker": {"p50_ms": 0.01, "p99_ms": 0.02, "max_ms": 0.1}}}
    fig.update(over)
    return fig


def cluster_report(**over) -> dict:
    voters = {str(n): {"rss_mib": 400.0 + n, "hwm_mib": 450.0, "snapshot_load_seconds": 1.0 + n / 10}
              for n in (1, 2, 3)}
    by_snap = {"catchup_seconds": 3.0, "snapshot_bytes": 150_000_000, "download_mb_per_s": 50.0,
               "install_seconds": 2.0, "download_rss_start_mib": 70.0, "download_rss_peak_mib": 72.0,
               "download_rss_bound_mib": 36.0, "download_memory_bounded": True, "observer_peak_rss_mib": 500.0,
               "voters": voters, "admin_reads": {"topic": {"p50_ms": 1.0, "p99_ms": 3.0, "samples": 200},
                                                 "broker": {"p50_ms": 0.5, "p99_ms": 0.8, "samples": 200}}}
    rep = {"catchup": {"by_snapshot": by_snap, "by_log": {"catchup_seconds": 30.0}, "snapshot_speedup": 10.0},
           "commit": {"idle": {"p50_ms": 2.0, "p99_ms": 5.0, "samples": 2700},
                      "during_snapshot": {"p50_ms": 3.0, "p99_ms": 9.0, "samples": 900},
                      "generation_window_seconds": 4.0, "p99_ratio": 1.8}}
    for key, value in over.items():
        rep[key] = value
    return rep


def verdicts(rows: list[Row]) -> dict[str, bool | None]:
    return {r.goal: r.passed for r in rows}


def test_every_goal_passes_when_every_figure_meets_it():
    rows = rows_from(snapshot_figures(), cluster_report())
    got = verdicts(rows)
    assert {r.item for r in rows} == {"1", "2", "3", "4"}
    # The one row without a goal (time and MB/s) is printed, every other passes.
    assert [g for g, v in got.items() if v is None] == ["catch-up by snapshot: time and MB/s printed"]
    assert all(v for g, v in got.items() if v is not None)
    load = next(r for r in rows if r.goal.startswith("snapshot load"))
    assert load.figure.startswith("1.25 s")  # a fresh process's load
    assert "slowest 1.30 s" in load.figure  # beside the slowest booting voter's, not the first


def test_each_goal_fails_on_its_own_figure():
    # replay 9.0 s / load 2.01 s = 4.5x: both item 1 load goals fail
    snap = snapshot_figures(replay_records_per_s=399_999.0,
                            fresh_load={"seconds": 2.01, "cpu_seconds": 2.0, "rss_mib": 430.0})
    rep = cluster_report()
    rep["catchup"]["by_snapshot"]["voters"]["2"]["rss_mib"] = 513.0
    rep["catchup"]["snapshot_speedup"] = 4.99
    rep["catchup"]["by_snapshot"]["download_memory_bounded"] = False
    rep["catchup"]["by_snapshot"]["admin_reads"]["topic"]["p99_ms"] = 5.5
    rep["commit"]["p99_ratio"] = 2.01
    got = verdicts(rows_from(snap, rep))
    failed = {g for g, v in got.items() if v is False}
    assert failed == {g for g in got if g not in ("catch-up by snapshot: time and MB/s printed",
                                                   "a query for broker answers in <= 5 ms (p99)")}


def test_a_missing_figure_fails_its_goal_instead_of_passing():
    rep = cluster_report()
    del rep["commit"]
    rep["catchup"]["by_snapshot"]["voters"] = {"1": {"rss_mib": 0, "snapshot_load_seconds": None}}
    got = verdicts(rows_from({}, rep))
    assert got["commit p99 during snapshot generation <= 2x idle (1 client)"] is False
    assert got["snapshot load <= 2 s (a broker's boot: a fresh process)"] is False
    assert got["load >= 5x faster than replay (same run)"] is False
    assert got["replay >= 400k records/s"] is False
    assert got["a broker holding the state in <= 512 MiB RSS (largest voter)"] is False


def test_render_marks_the_section_and_escapes_cells():
    text = render_section([Row("2", "p99 | ratio", "1.5x", True), Row("3", "speed", "9x", False),
                           Row("3", "MB/s", "50", None)], "Scale figures", "a loaded machine")
    lines = text.splitlines()
    assert lines[0] == SECTION_BEGIN and lines[-1] == SECTION_END
    assert "| 2 | p99 \\| ratio | 1.5x | pass |" in lines
    assert "| 3 | speed | 9x | **fail** |" in lines
    assert "| 3 | MB/s | 50 | printed |" in lines
    assert "a loaded machine" in lines


def test_replace_keeps_the_text_around_the_section():
    old = render_section([Row("1", "old goal", "old", False)], "Scale figures", "old note")
    doc = "# Benchmarks\n\nbefore\n\n" + old + "\n## After\n\nafter\n"
    new = render_section([Row("1", "new goal", "new", True)], "Scale figures", "new note")
    out = replace_section(doc, new)
    assert out == "# Benchmarks\n\nbefore\n\n" + new + "\n## After\n\nafter\n"
    assert replace_section(out, new) == out  # idempotent


def test_append_when_the_file_has_no_section():
    new = render_section([Row("1", "g", "f", True)], "Scale figures", "n")
    assert replace_section("# Benchmarks\n\ntext\n\n\n", new) == "# Benchmarks\n\ntext\n\n" + new


@pytest.mark.parametrize("broken", [
    f"{SECTION_BEGIN}\nno end\n",
    f"{SECTION_END}\n{SECTION_BEGIN}\n",
    f"{SECTION_BEGIN}\n{SECTION_END}\n{SECTION_BEGIN}\n{SECTION_END}\n",
])
def test_broken_markers_are_refused_and_the_file_is_left_alone(tmp_path, broken):
    """The user sees SectionError naming the markers; docs/bench.md is unchanged."""
    path = tmp_path / "bench.md"
    path.write_text("# Benchmarks\n" + broken)
    with pytest.raises(SectionError, match="scale:"):
        write_docs(str(path), render_section([], "Scale figures", "n"))
    assert path.read_text() == "# Benchmarks\n" + broken


def test_write_docs_replaces_in_place(tmp_path):
    path = tmp_path / "bench.md"
    path.write_text("# Benchmarks\n")
    write_docs(str(path), render_section([Row("1", "g", "first", True)], "Scale figures", "n"))
    write_docs(str(path), render_section([Row("1", "g", "second", False)], "Scale figures", "n"))
    text = path.read_text()
    assert text.count(SECTION_BEGIN) == 1 and "second" in text and "first" not in text


def test_split_batches_cuts_at_batch_boundaries():
    batches = [b.encode_batch(0, 1, [b"a", b"bb"], 0), b.encode_batch(2, 1, [b"c" * 300], 0)]
    assert catchup.split_batches(b"".join(batches)) == batches
    with pytest.raises(AssertionError, match="the batches end at byte"):
        catchup.split_batches(batches[0] + batches[1][:-1])


def test_sizes_follow_the_headline_shape():
    topics, brokers, records = catchup.sizes_for(2_000_000)
    assert (topics, brokers) == (20_000, 300)
    assert records == (300 + 20_000 + 2_000_000) * 11 // 10  # 2,222,330: every entity once, then 10% changes


def test_the_scale_table_has_a_row_per_read_and_listing_page():
    """Item 4's rows in docs/bench.md's table: one topic and one broker (the
    admin API's p99 and the in-process view + JSON), and a page of topics and
    of a topic's partitions; a p99 over 5 ms fails its row."""
    def lat(p99):
        return {"p50_ms": 0.5, "p99_ms": p99, "samples": 500}

    reads = {"topic": lat(1.2), "broker": lat(0.6), "topics page": lat(6.1), "partitions page": lat(1.0)}
    rows = [r for r in rows_from({}, {"catchup": {"by_snapshot": {"catchup_seconds": 1.0, "admin_reads": reads}}}) if r.item == "4"]
    assert [(r.goal, r.passed) for r in rows] == [
        ("a query for topic answers in <= 5 ms (p99)", True),
        ("a query for broker answers in <= 5 ms (p99)", True),
        ("a topics listing pages; a page of 100 answers in <= 5 ms (p99)", False),
        ("a partitions listing pages; a page of 100 answers in <= 5 ms (p99)", True),
    ]
    assert rows[2].figure == "admin API over TLS p50 0.5 / p99 6.1 ms"

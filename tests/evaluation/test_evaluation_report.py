"""The paper's table: rows per set and domain, the averages over whole sets, JSON and Markdown."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from exgrpo_pl.checkpoints import atomic_writes
from exgrpo_pl.checkpoints.atomic_writes import write_files_atomically
from exgrpo_pl.evaluation.report import build_table, report_files, report_is_whole, to_markdown

RESULTS = {
    "aime24": {"avg@32": 0.25, "pass@32": 0.6, "pass@1": 0.25, "mean_length": 812.4, "problems": 30.0},
    "math500": {"avg@1": 0.75, "mean_length": 400.0, "problems": 500.0},
    "math500/algebra": {"avg@1": 0.9, "problems": 100.0},
    "gpqa": {"avg@1": 0.3, "problems": 198.0},
}


def test_averages_are_over_whole_sets_split_by_distribution():
    table = build_table(RESULTS, out_of_distribution=["gpqa"])
    assert table["averages"] == pytest.approx(
        {"in-distribution": 0.5, "out-of-distribution": 0.3, "all": 1.3 / 3}
    )
    assert table["rows"]["aime24"]["score"] == 0.25 and table["rows"]["math500/algebra"]["score"] == 0.9
    assert "out-of-distribution" not in build_table(RESULTS)["averages"]


def test_an_unknown_out_of_distribution_set_is_an_error():
    with pytest.raises(
        ValueError, match=r"out_of_distribution or by_domain name sets with no results: \['arc'\]"
    ):
        build_table(RESULTS, out_of_distribution=["arc"])


def test_a_mixed_set_averaged_by_domain_counts_each_domain_as_a_benchmark():
    results = {**RESULTS, "math500/geometry": {"avg@1": 0.5, "problems": 400.0}}
    table = build_table(results, out_of_distribution=["gpqa"], by_domain=["math500"])
    # aime24, math500/algebra and math500/geometry in distribution; math500's own score is left out.
    assert table["averages"]["in-distribution"] == pytest.approx((0.25 + 0.9 + 0.5) / 3)
    assert table["averages"]["all"] == pytest.approx((0.25 + 0.9 + 0.5 + 0.3) / 4)


def test_a_set_averaged_by_domain_that_holds_one_domain_keeps_its_average():
    alone = build_table({"aime24": RESULTS["aime24"]}, by_domain=["aime24"])
    assert alone["averages"] == {"in-distribution": 0.25, "all": 0.25}
    beside = build_table({"aime24": RESULTS["aime24"], "gpqa": RESULTS["gpqa"]}, by_domain=["aime24"])
    assert beside["averages"]["all"] == pytest.approx((0.25 + 0.3) / 2)


def test_markdown_and_json_land_next_to_each_other(tmp_path):
    table = build_table(RESULTS, out_of_distribution=["gpqa"])
    markdown = to_markdown(table)
    lines = markdown.splitlines()
    assert lines[0] == "| set | score | avg@1 | avg@32 | pass@1 | pass@32 | mean_length | problems |"
    assert lines[2] == "| aime24 | 25.0 |  | 25.0 | 25.0 | 60.0 | 812.4 | 30 |"
    assert lines[-3:] == [
        "| average (in-distribution) | 50.0 | | | | | | |",
        "| average (out-of-distribution) | 30.0 | | | | | | |",
        "| average (all) | 43.3 | | | | | | |",
    ]
    (json_path, text), (markdown_path, md) = report_files(table, tmp_path / "logs", "test").items()
    assert json_path == tmp_path / "logs" / "test.json" and markdown_path == tmp_path / "logs" / "test.md"
    digest = hashlib.sha256(markdown.encode()).hexdigest()
    assert json.loads(text) == {**table, "markdown_sha256": digest} and md == markdown


def test_a_kill_between_the_renames_leaves_a_json_that_does_not_name_the_markdown(tmp_path, monkeypatch):
    """The Markdown is renamed into place first, the JSON, which names the Markdown's digest, last."""
    table = {"rows": {"held": {"avg@4": 0.5, "problems": 4}}, "averages": {}}
    files = report_files(table, tmp_path, "test")
    write_files_atomically(files)
    assert report_is_whole(*files)
    renamed = []

    def killed_after_the_first(source, target):
        if renamed:
            raise KeyboardInterrupt  # as far as the disk goes, a kill between the two renames
        renamed.append(Path(target).name)
        os.rename(source, target)

    monkeypatch.setattr(atomic_writes.os, "replace", killed_after_the_first)
    new = report_files({"rows": {"held": {"avg@2": 0.25, "problems": 4}}, "averages": {}}, tmp_path, "test")
    with pytest.raises(KeyboardInterrupt):
        write_files_atomically(new)
    assert renamed == ["test.md"] and (tmp_path / "test.md").read_text() == new[tmp_path / "test.md"]
    assert json.loads((tmp_path / "test.json").read_text())["rows"]["held"]["avg@4"] == 0.5  # the previous
    assert not report_is_whole(*files)

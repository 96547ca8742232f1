"""The documentation pages' tables of results are the results files' (docs/learning.md from learning.json and
learning_yardstick.json, its verdict too, docs/reliability.md from resume_exact.json and hostile_probes.json,
docs/performance.md's quickstart row from quickstart_speed.json, docs/getting-started.md's spread of the
quickstart over seeds from learning.json)."""

import importlib
import json
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import headline  # noqa: E402
import hostile_probes  # noqa: E402
import resume_exact  # noqa: E402
from learning import markdown_table, mean_completion_tokens, presets_table  # noqa: E402
from learning_yardstick import table as yardstick_table  # noqa: E402


def test_the_learning_page_shows_the_tables_of_the_results_file():
    summary = json.loads((ROOT / "benchmarks" / "results" / "learning.json").read_text())["summary"]
    page = (ROOT / "docs" / "learning.md").read_text()
    for task, entry in summary.items():
        table = markdown_table(entry["variants"])
        assert table in page, (
            f"docs/learning.md should show the {task} table of benchmarks/results/learning.json as "
            "benchmarks/learning.py prints it:\n" + table
        )
    presets = presets_table(summary)
    assert presets in page, "docs/learning.md should show the presets table learning.py prints:\n" + presets


def test_the_reliability_page_shows_the_resume_table_of_the_results_file():
    results = json.loads((ROOT / "benchmarks" / "results" / "resume_exact.json").read_text())
    table = resume_exact.markdown_table(results)
    assert table in (ROOT / "docs" / "reliability.md").read_text(), (
        "docs/reliability.md should show benchmarks/results/resume_exact.json as benchmarks/resume_exact.py "
        "prints it:\n" + table
    )


def test_the_reliability_page_shows_every_probe_of_the_hostile_probes_results_file():
    results = json.loads((ROOT / "benchmarks" / "results" / "hostile_probes.json").read_text())
    assert [result["probe"] for result in results] == list(hostile_probes.PROBES), (
        "benchmarks/results/hostile_probes.json should hold every probe of benchmarks/hostile_probes.py, in "
        "its order: run the new ones with `python benchmarks/hostile_probes.py --only NAME`"
    )
    page = (ROOT / "docs" / "reliability.md").read_text()
    for text in (hostile_probes.outcome_counts(results), hostile_probes.markdown_table(results)):
        assert text in page, (
            "docs/reliability.md should show benchmarks/results/hostile_probes.json as "
            "benchmarks/hostile_probes.py prints it:\n" + text
        )


def test_the_learning_page_shows_the_yardstick_table_of_its_results_file():
    summary = json.loads((ROOT / "benchmarks" / "results" / "learning_yardstick.json").read_text())["summary"]
    page = (ROOT / "docs" / "learning.md").read_text()
    for task, variants in summary.items():  # a table per task, each where the page discusses it
        table = yardstick_table({task: variants})
        assert table in page, (
            f"docs/learning.md should show the {task} table of benchmarks/results/learning_yardstick.json as "
            "benchmarks/learning_yardstick.py prints it:\n" + table
        )


def test_the_learning_page_shows_the_hypotheses_verdicts_of_its_results_file():
    from hypotheses import decide, results_files, verdict_table

    table = verdict_table(decide(results_files()))
    assert table in (ROOT / "docs" / "learning.md").read_text(), (
        "docs/learning.md should show the verdicts as benchmarks/hypotheses.py prints them:\n" + table
    )


def test_the_learning_page_shows_the_one_commit_runs_below_the_hypotheses_they_decide():
    """H9 and H10's runs: each variant's figures from benchmarks/results/dynamic_sampling.json as headline.py
    and the yardstick print them, below the section that wrote H9 and H10 down before the runs."""
    from hypotheses import ONE_COMMIT

    results = json.loads((ROOT / "benchmarks" / "results" / f"{ONE_COMMIT}.json").read_text())
    page = (ROOT / "docs" / "learning.md").read_text()
    written_before = page.index("## Replay or fuller groups? Dynamic sampling as the control")
    assert page.find(headline.table(results)) > written_before, (
        "docs/learning.md should show, below H9 and H10, the runs as benchmarks/headline.py prints them:\n"
        + headline.table(results)
    )
    for task, variants in results["summary"].items():  # and every figure, as the yardstick prints them
        table = yardstick_table({task: variants})
        assert page.find(table) > written_before, f"docs/learning.md should show, below H9 and H10:\n{table}"


def test_the_learning_page_shows_the_official_pick_runs_below_the_paper_preset_s_rerun():
    """The recommended preset with its own and with the official code's trajectory pick, made at one commit
    (benchmarks/results/official_pick.json): the comparison as hypotheses.py prints it, and every figure."""
    from hypotheses import OFFICIAL_PICK, OFFICIAL_PICK_COMPARED, reported_table, results_files

    page = (ROOT / "docs" / "learning.md").read_text()
    rerun = page.index("## The paper preset as the official code runs it, rerun")
    compared = reported_table(results_files(), only=OFFICIAL_PICK_COMPARED)
    assert "—" not in compared, "every task's official-pick comparison should have its runs:\n" + compared
    assert page.find(compared) > rerun, f"docs/learning.md should show, below the rerun:\n{compared}"
    results = json.loads((ROOT / "benchmarks" / "results" / f"{OFFICIAL_PICK}.json").read_text())
    for task, variants in results["summary"].items():
        table = yardstick_table({task: variants})
        assert page.find(table) > rerun, f"docs/learning.md should show, below the rerun:\n{table}"
    tasks = ("reasoning", "arithmetic", "small_pool", "weak_start")  # the order the page names them in
    for variant in ("recommended, official trajectory pick", "ExGRPO recommended"):  # replayed lengths
        means = [
            f"{mean_completion_tokens(results['runs'][task][variant], 'replayed')[0]:.2f}" for task in tasks
        ]
        said = ", ".join(means[:-1]) + " and " + means[-1]
        assert said in " ".join(page.split()), f"docs/learning.md should say {variant} replays {said} tokens"


def test_the_performance_page_quotes_the_quickstart_speed_file():
    result = json.loads((ROOT / "benchmarks" / "results" / "quickstart_speed.json").read_text())
    (baseline, base), (_, current) = result["median"].items()
    commit = baseline.removeprefix("baseline ")
    row = (
        f"| quickstart wall time, this checkout / `{commit}` | {result['ratio']:.2f}x ({current:.1f} vs "
        f"{base:.1f} s,"
    )
    page = (ROOT / "docs" / "performance.md").read_text()
    assert row in page and f"`python benchmarks/quickstart_speed.py --baseline {commit}" in page, (
        "docs/performance.md should quote benchmarks/results/quickstart_speed.json:\n" + row
    )
    assert result["config"] == "configs/quickstart.yaml" and result["steps"] is None  # the whole quickstart


def test_every_docstring_renders_as_written():
    pytest.importorskip("griffe")  # the `docs` extra; CI's `mkdocs build --strict` runs the same check
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    from docstrings import problems

    assert problems() == []


def test_the_getting_started_page_quotes_the_quickstart_over_seeds():
    """The quickstart's gain over the learning benchmark's seeds: its runs of "ExGRPO recommended" on the
    reasoning task are quickstart runs (tests/test_configs.py keeps the two configs equal)."""
    runs = json.loads((ROOT / "benchmarks" / "results" / "learning.json").read_text())["runs"]
    gains = sorted(
        100 * (run["curve"][-1][2] - run["curve"][0][2]) for run in runs["reasoning"]["ExGRPO recommended"]
    )
    sentence = (
        f"over its {len(gains)} seeds the gain's median is {statistics.median(gains):+.1f} points "
        f"(the smallest {gains[0]:+.1f})"
    )
    page = (ROOT / "docs" / "getting-started.md").read_text()
    paragraphs = [" ".join(p.split()) for p in page.split("\n\n")]
    assert any(
        sentence in p and "`python benchmarks/learning.py --jobs 2 --tasks reasoning`" in p
        for p in paragraphs
    ), f"docs/getting-started.md should say {sentence!r} beside the command that measured it"


def test_the_learning_page_opens_with_its_verdict_from_the_results_file():
    """The first screen of docs/learning.md: which preset, whether its gain is replay's (H9's verdict in one
    sentence), and the comparisons and words rendered from dynamic_sampling.json by benchmarks/headline.py."""
    page = (ROOT / "docs" / "learning.md").read_text().split("\n---\n", 1)[-1]  # below its front matter
    assert page.startswith("\n# Learning results\n\n## The verdict\n\n**Use the recommended preset**")
    verdict = page.split("\n## The record\n")[0]
    assert len(verdict.splitlines()) <= 40, "the verdict should fit one screen"
    results = json.loads((ROOT / "benchmarks" / "results" / "dynamic_sampling.json").read_text())
    assert headline.comparisons_table(results) in verdict
    words = " ".join(verdict.split())
    first_paragraph = " ".join(verdict.split("\n\n")[2].split())  # below the title and the heading
    assert f"On these tiny tasks, {headline.answer(results)}." in first_paragraph
    for phrase in headline.verdict(results):
        assert phrase in words, f"docs/learning.md's verdict should say {phrase!r}"


def test_the_home_page_says_what_the_one_commit_runs_show():
    """docs/index.md's "Does replay help?" in the words headline.py renders from dynamic_sampling.json."""
    results = json.loads((ROOT / "benchmarks" / "results" / "dynamic_sampling.json").read_text())
    page = " ".join((ROOT / "docs" / "index.md").read_text().split())
    for phrase in (headline.verdict(results)[0], headline.answer(results), headline.verdict(results)[2]):
        assert phrase in page, f"docs/index.md should say {phrase!r}"


def test_a_table_wider_than_its_column_at_1280_pixels_fails_the_docs_build():
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    import tables

    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    row = "<tr>" + "<td>0.585 ± 0.013 (+2.4 ± 1.1) generated</td>" * 10 + "</tr>"
    wide = f"<table><thead><tr>{'<th>x</th>' * 10}</tr></thead><tbody>{row}</tbody></table>"
    narrow = wide.replace("<th>x</th>" * 10, "<th>x</th>" * 3).replace(row, row.replace("</td><td>", "|", 7))
    (problem,) = tables.too_wide(wide, [], css)
    assert problem.startswith("a table needs") and "column is 718 px at 1280 px wide" in problem
    assert tables.too_wide(narrow, [], css) == []
    assert tables.too_wide(wide, ["toc", "navigation"], css) == []  # the whole window is wider


def test_a_code_span_in_a_table_wraps_between_its_parts():
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    import tables

    cell = '<table><tr><td><code>tests/a_b.py::test_x</code> <a href="x.y">x.y</a></td></tr></table>'
    assert tables.break_code(cell) == (
        "<table><tr><td><code>tests/<wbr>a_<wbr>b.<wbr>py::<wbr>test_<wbr>x</code> "
        '<a href="x.y">x.y</a></td></tr></table>'
    )
    assert tables.cell_min_width("<code>tests/<wbr>a_<wbr>b</code>", 20) < tables.cell_min_width(
        "<code>tests/a_b</code>", 20
    )


def test_the_search_index_holds_each_class_name_whole_in_lower_case():
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    from search_names import add_names

    first = {"title": "Callbacks", "text": "`ReplayCallback` and DifficultyMonitor, ReplayCallback"}
    index = {"docs": [first, {"title": "Plain", "text": "no class here"}]}
    assert add_names(index)["docs"] == [
        {**index["docs"][0], "names": "replaycallback difficultymonitor"},
        {"title": "Plain", "text": "no class here"},
    ]


def test_the_replay_contract_agrees_with_the_code():
    """Its code block is labelled a sketch, the loss helpers are named with their module, a replayed
    question's columns are the stored ones (not None), and each import path it names imports."""
    page = (ROOT / "docs" / "replay_contract.md").read_text()
    first_block = page.index("```python")
    assert page[:first_block].rstrip().rsplit("\n\n", 1)[-1].startswith("A sketch")
    for name in ("LossNormaliser", "compute_grpo_loss"):
        bare = re.findall(rf"(?<![.\w]){name}", page)
        assert not bare, f"{name} named without its module (exgrpo_pl.step.losses.{name})"
    assert "entries are None" not in page and "`RolloutBatch.columns`), None only for a column" in page
    for path in set(re.findall(r"exgrpo_pl(?:\.\w+)+", page)):
        module, _, name = path.rpartition(".")
        try:
            importlib.import_module(path)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module), name), f"{path} is not in the code"

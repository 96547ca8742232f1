"""The README: short and in the order a newcomer reads it, its code example runs as written, its commands
are CI's, and every number in it has a source.

A number in the README's prose (code blocks, inline code and link targets aside: those are commands, code,
and what the command above them prints) must be one of:

- read from a results file under benchmarks/results/ by one of `FROM_RESULTS`, which renders the README's
  text from the file; that text must sit in the same paragraph or table row as the command that wrote the
  file, so a rerun that changes the file fails here until the README says what it measured;
- in a table of `TABLES`, rendered from a results file, right below a paragraph naming the command that
  wrote the file (the headline results table, `benchmarks/headline.py`), whose verdict sentence above it
  must say what the table shows;
- in a sentence matched by one of `BESIDE`, in the same paragraph as the command that produces it (the
  quickstart's numbers: `scripts/check_quickstart.py` reruns the quickstart and compares);
- one of `NOT_MEASUREMENTS`.

Anything else fails `test_every_number_in_the_readme_has_a_source`, which names the number and its line.
"""

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from exgrpo_pl.experience import SelectiveReplay

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by name
import headline  # noqa: E402


def results(name: str):
    return json.loads((RESULTS / name).read_text())


def _resume_cases() -> str:
    cases = results("resume_exact.json").values()
    return f"bitwise in {sum(case['exact'] for case in cases)} of {len(cases)} cases"


def _kill_trials() -> str:
    rows = [row for row in results("checkpoint_kill.json")["summary"] if row["writer"] == "exgrpo"]
    return f"in {sum(row['resumed'] for row in rows)} of {sum(row['trials'] for row in rows)} trials"


# (the command that writes the results file, the README's text rendered from the file)
FROM_RESULTS: list[tuple[str, Callable[[], str]]] = [
    ("python benchmarks/resume_exact.py", _resume_cases),
    ("python benchmarks/checkpoint_kill.py", _kill_trials),
]

# (the command that writes the results file, the README's table rendered from the file): the table must sit
# right below a paragraph that names the command.
TABLES: list[tuple[str, Callable[[], str]]] = [
    (
        "python benchmarks/learning_yardstick.py --jobs 2 --resume --seeds 10 --results dynamic_sampling "
        '--variants GRPO "ExGRPO recommended" "recommended, fresh refill" "GRPO, dynamic sampling"',
        lambda: headline.table(results("dynamic_sampling.json")),
    ),
]


def verdict() -> list[str]:
    """The phrases in which the README says what the results table shows, and whether the gain is replay's."""
    one_commit = results("dynamic_sampling.json")
    return [*headline.verdict(one_commit), headline.answer(one_commit)]


# (the command, a pattern of the sentence whose numbers it produces)
BESIDE: list[tuple[str, str]] = [
    (
        "python scripts/check_quickstart.py --native",
        r"went\s+from\s+\*\*[0-9.]+ to [0-9.]+\*\*, best [0-9.]+ at step \d+",
    ),
]

# Numbers that name something rather than measure it.
NOT_MEASUREMENTS = {"2510.02245": "the paper's arXiv id", "95%": "the intervals' confidence level"}

NUMBER = re.compile(r"(?<![\w.@/+\-−])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:x|K|M|B|%)?(?!\w)")


class Block(NamedTuple):
    """A paragraph or table row outside code blocks, its lines joined by one space."""

    line: int  # its first line in README.md
    text: str  # without inline code and link targets
    commands: set[str]  # its inline code


def prose_blocks(markdown: str) -> list[Block]:
    blocks: list[Block] = []
    current: list[str] = []
    start, fenced = 0, False

    def add(line: int, raw: str) -> None:
        text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "``", raw))
        blocks.append(Block(line, text, set(re.findall(r"`([^`]*)`", raw))))

    def close() -> None:
        if current:
            add(start, " ".join(current))
            current.clear()

    for number, line in enumerate(markdown.splitlines(), 1):
        line = line.strip()
        if line.startswith("```"):
            close()
            fenced = not fenced
        elif fenced:
            continue
        elif not line or line.startswith("|"):
            close()
            if line:
                add(number, line)
        else:
            start = start if current else number
            current.append(line)
    close()
    return blocks


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", markdown, flags=re.S | re.M)


PLAIN_SAMPLE = SelectiveReplay.sample


def test_readme_example_runs(tmp_path, monkeypatch):
    blocks = [block for language, block in code_blocks(README.read_text()) if language == "python"]
    example = next(b for b in blocks if "ReplayCallback(" in b and "trainer.fit" in b)
    monkeypatch.chdir(tmp_path)
    drawn = []  # every replay draw: the snippet replays correct solutions only

    def sample(self, *args, **kwargs):
        drawn.append(PLAIN_SAMPLE(self, *args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(SelectiveReplay, "sample", sample)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert scope["trainer"].global_step == 4
    assert len(scope["replay"].buffer) > 0
    assert scope["replay"].replayed_steps > 0 and all(bool(rows.correct.all()) for rows in drawn)


def test_each_number_read_from_a_results_file_is_what_the_file_holds():
    blocks = prose_blocks(README.read_text())
    for command, render in FROM_RESULTS:
        expected = render()
        beside = [block for block in blocks if expected in block.text]
        assert beside, f"README.md should say {expected!r} (from the results of `{command}`)"
        assert any(command in block.commands for block in beside), (
            f"`{command}` should sit beside {expected!r}"
        )


def test_the_numbers_beside_a_command_sit_beside_it():
    blocks = prose_blocks(README.read_text())
    for command, pattern in BESIDE:
        beside = [block for block in blocks if re.search(pattern, block.text)]
        assert beside, f"README.md has no sentence matching {pattern!r}"
        assert all(command in block.commands for block in beside), (
            f"`{command}` should sit beside {pattern!r}"
        )


def test_each_table_read_from_a_results_file_is_what_the_file_holds():
    text = README.read_text()
    for command, render in TABLES:
        table = render()
        assert table in text, f"README.md should show this table (from the results of `{command}`):\n{table}"
        caption = " ".join(text.split(table)[0].rstrip().split("\n\n")[-1].split())  # its lines joined
        assert f"`{command}`" in caption, f"the paragraph above the table should name `{command}`"


def test_the_verdict_says_what_the_results_table_shows():
    paragraph = next(
        block.text for block in prose_blocks(README.read_text()) if "Does replay help?" in block.text
    )
    for phrase in verdict():
        assert phrase in paragraph, f"README.md's verdict should say {phrase!r}"


def test_the_readme_is_short_and_in_a_newcomers_order():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == [
        "What the quickstart prints",
        "Results",
        "Replay in your own module",
        "Status",
        "Where to read on",
    ]
    first_screen = text.split("\n## ")[0]  # what it is, whether replay helps, and the two commands
    assert "Does replay help?" in first_screen and first_screen.count("pip install") == 2


def test_every_number_in_the_readme_has_a_source():
    sourced = [render() for _, render in FROM_RESULTS] + verdict()
    sourced += [row for _, render in TABLES for row in render().splitlines()]
    unsourced = []
    for line, text, _ in prose_blocks(README.read_text()):
        covered = [m.span() for expected in sourced for m in re.finditer(re.escape(expected), text)]
        covered += [m.span() for _, pattern in BESIDE for m in re.finditer(pattern, text)]
        for number in NUMBER.finditer(text):
            inside = any(a <= number.start() and number.end() <= b for a, b in covered)
            if not inside and number.group() not in NOT_MEASUREMENTS:
                unsourced.append(f"line {line}: {number.group()!r} in {text[:80]!r}")
    assert not unsourced, (
        "numbers in README.md with no results file or command as their source:\n" + "\n".join(unsourced)
    )


def test_the_quickstart_output_agrees_with_the_sentence_about_it():
    text = README.read_text()
    # The sentence about the plain command on this project's machine, which the printed output shows
    # (scripts/check_quickstart.py --native reruns it).
    (claim,) = re.finditer(r"went\s+from\s+\*\*(?P<start>[0-9.]+) to (?P<final>[0-9.]+)\*\*", text)
    output = next(block for _, block in code_blocks(text) if "Training finished." in block)
    start = re.search(r"val/pass@1 before training: (\S+)", output).group(1)
    final = re.findall(r"val/pass@1: (\S+)", output)[-1]
    assert (start, final) == (claim["start"], claim["final"]), "the printed output and the sentence differ"


def test_the_readme_has_two_setup_commands_and_the_tests_one_is_what_ci_runs():
    bash = [block for language, block in code_blocks(README.read_text()) if language == "bash"]
    commands = [line for block in bash for line in block.splitlines() if "pip install" in line]
    assert len(commands) == 2, commands
    quickstart, tests = commands
    assert quickstart.endswith("exgrpo fit --config configs/quickstart.yaml")
    install, run = tests.split(" && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert install + " || exit 1" in [line.replace(" -q", "") for line in ci.splitlines()]
    assert (
        run == "python -m pytest"
        and 'python -m pytest "$@"' in ci
        and re.search(r"^run_pytest -q( \|\||$)", ci, re.M)
    )


def test_every_picture_in_the_readme_is_a_file_in_the_repository():
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README.read_text())
    assert pictures, "the README shows the learning curves"
    for picture in pictures:
        assert (ROOT / picture).is_file(), picture

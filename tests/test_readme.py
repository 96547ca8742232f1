"""The README: its code example runs as written, its commands are CI's, and every number in it has a source.

A number in the README's prose (code blocks, inline code and link targets aside: those are commands, code,
and what the command above them prints) must be one of:

- read from a results file under benchmarks/results/ by one of `FROM_RESULTS`, which renders the README's
  text from the file; that text must sit in the same paragraph or table row as the command that wrote the
  file, so a rerun that changes the file fails here until the README says what it measured;
- in a sentence matched by one of `BESIDE`, in the same paragraph as the command that produces it (the
  quickstart's numbers: `scripts/check_quickstart.py` reruns the quickstart and compares);
- one of `NOT_MEASUREMENTS`.

Anything else fails `test_every_number_in_the_readme_has_a_source`, which names the number and its line.
"""

import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from exgrpo_pl.experience import SelectiveReplay

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"


def results(name: str):
    return json.loads((RESULTS / name).read_text())


def _resume_cases() -> str:
    cases = results("resume_exact.json").values()
    return f"bitwise in {sum(case['exact'] for case in cases)} of {len(cases)} cases"


def _kill_trials() -> str:
    rows = [row for row in results("checkpoint_kill.json")["summary"] if row["writer"] == "exgrpo"]
    return f"in {sum(row['resumed'] for row in rows)} of {sum(row['trials'] for row in rows)} trials"


def _learning_headline() -> str:
    summary = results("learning.json")["summary"]

    def versus(row: dict) -> str:
        difference, half_width = row["vs_grpo_points"]
        return f"{row['final'][0]:.3f} ({difference:+.1f} ± {half_width:.1f} points, {row['seeds']} seeds)"

    def task(name: str) -> str:
        variants = summary[name]["variants"]
        grpo, paper, ours = (variants[v] for v in ("GRPO", "ExGRPO paper", "ExGRPO recommended"))
        return (
            f"on the {name.replace('_', '-')} task GRPO ends at {grpo['final'][0]:.3f}, "
            f"the paper's preset at {versus(paper)} and the recommended preset at {versus(ours)}"
        )

    return "; ".join(task(name) for name in ("reasoning", "arithmetic", "small_pool"))


def _quickstart_seeds() -> str:
    """The quickstart's gain over the seeds of the learning benchmark: its runs of "ExGRPO recommended" on the
    reasoning task are quickstart runs (tests/test_configs.py keeps the two configs equal)."""
    runs = results("learning.json")["runs"]["reasoning"]["ExGRPO recommended"]
    gains = sorted(100 * (run["curve"][-1][2] - run["curve"][0][2]) for run in runs)
    return (
        f"over its {len(gains)} seeds the gain's median is {statistics.median(gains):+.1f} points "
        f"(the smallest {gains[0]:+.1f})"
    )


def _yardstick_headline() -> str:
    """The recommended preset against GRPO under both yardsticks, reasoning task (learning_yardstick.py)."""
    row = results("learning_yardstick.json")["summary"]["reasoning"]["ExGRPO recommended"]

    def versus(column: str) -> str:
        difference, half_width = row[column]["vs_grpo"]
        return f"{difference:+.1f} ± {half_width:.1f}"

    ood_grpo = results("learning_yardstick.json")["summary"]["reasoning"]["GRPO"]["OOD avg@4, T=0.6"]["mean"]
    ood_ours = row["OOD avg@4, T=0.6"]["mean"]
    parts = [
        f"over {row['seeds']} paired seeds the recommended preset ends",
        f"{versus('ours: val pass@1, T=1')} points from GRPO at T = 1,",
        f"{versus('ID avg@4, T=0.6')} at T = 0.6 (avg@4) and {versus('ID greedy')} greedy in distribution,",
        f"and {versus('OOD avg@4, T=0.6')} at T = 0.6 out of distribution, where GRPO's seeds spread over",
        f"{ood_grpo[0]:.3f} ± {ood_grpo[1]:.3f} and the recommended preset's over",
        f"{ood_ours[0]:.3f} ± {ood_ours[1]:.3f}",
    ]
    return " ".join(parts)


def _per_fresh_question() -> str:
    """H7's comparisons (benchmarks/hypotheses.py) as the README states them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by name
    from hypotheses import HYPOTHESES, decide

    (h7,) = (h for h in decide(results("learning_yardstick.json")["runs"]) if h["name"] == "H7")
    seeds = next(h.seeds for h in HYPOTHESES if h.name == "H7")
    found = {row["task"]: next(iter(row["intervals"].values())) for row in h7["comparisons"]}
    text = {task: f"{mean:+.1f} ± {half:.1f}" for task, (mean, half) in found.items()}
    return (
        f"tested over {seeds} seeds, per fresh question the recommended preset with displace ends "
        f"{text['small_pool']} points from GRPO on the small pool and {text['arithmetic']} on arithmetic"
    )


def _exact_paper() -> str:
    """The paper preset made exact against it before (hypotheses.py's reported comparisons), at T = 1."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hypotheses import DECIDING, REPORTED, paired

    runs = results("learning_yardstick.json")["runs"]
    found = {
        task: paired(runs, task, a, b, DECIDING[0])
        for what, task, a, b in REPORTED
        if what == "the paper preset made exact"
    }
    text = {task: f"{mean:+.1f} ± {half:.1f}" for task, (mean, half) in found.items()}
    return (
        f"it ends {text['reasoning']} points from the preset before at T = 1 on the reasoning task, "
        f"{text['arithmetic']} on arithmetic, {text['small_pool']} on the small pool and "
        f"{text['weak_start']} on the weak start"
    )


def _refill() -> str:
    """H6's comparisons (benchmarks/hypotheses.py) and refill's generated tokens over GRPO's, as the README
    states them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hypotheses import HYPOTHESES, decide
    from learning_yardstick import TOKENS_VS_GRPO

    (h6,) = (h for h in decide(results("learning_yardstick.json")["runs"]) if h["name"] == "H6")
    seeds = next(h.seeds for h in HYPOTHESES if h.name == "H6")
    names = {"arithmetic": "arithmetic", "reasoning": "the reasoning task", "small_pool": "the small pool",
             "weak_start": "the weak start"}  # fmt: skip
    per_task = [
        f"{t1[0]:+.1f} ± {t1[1]:.1f} and {t06[0]:+.1f} ± {t06[1]:.1f}" for row in h6["comparisons"]
        for t1, t06 in [tuple(row["intervals"].values())]
    ]  # fmt: skip
    tasks = [names[row["task"]] for row in h6["comparisons"]]
    first = f"{per_task[0]} points from GRPO on {tasks[0]} (at T = 1, and in distribution at T = 0.6)"
    rest = [f"{figures} on {task}" for figures, task in zip(per_task[1:], tasks[1:])]
    summary = results("learning_yardstick.json")["summary"]
    ratios = [summary[row["task"]]["ExGRPO recommended"][TOKENS_VS_GRPO][0] for row in h6["comparisons"]]
    return (
        f"over {seeds} paired seeds, with refill the recommended preset ends {first}, {', '.join(rest[:-1])} "
        f"and {rest[-1]} (H6 {h6['verdict']}), generating {min(ratios):.2f}-{max(ratios):.2f} times GRPO's "
        "tokens"
    )


def _join() -> str:
    """H5's comparison (benchmarks/hypotheses.py) and join's replays, as the README states them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hypotheses import HYPOTHESES, decide

    (h5,) = (h for h in decide(results("learning_yardstick.json")["runs"]) if h["name"] == "H5")
    seeds = next(h.seeds for h in HYPOTHESES if h.name == "H5")
    (row,) = h5["comparisons"]
    (t1, t06), runs = row["intervals"].values(), results("learning_yardstick.json")["runs"][row["task"]]
    replays = [
        statistics.mean(r["diagnostics"]["replays"] for r in runs[variant])
        for variant in (row["a"], "ExGRPO recommended")
    ]
    return (
        f"over {seeds} paired seeds on the small pool, with join the recommended preset ends {t1[0]:+.1f} ± "
        f"{t1[1]:.1f} and {t06[0]:+.1f} ± {t06[1]:.1f} points from GRPO (H5 {h5['verdict']}), replaying "
        f"{replays[0]:,.0f} trajectories a run where refill replays {replays[1]:,.0f}"
    )


def _replay_on_one_pass() -> str:
    """Refill against join on the one-pass tasks, where join never acts (learning_yardstick.py's runs): what
    the recommended preset's replay adds over the same module without it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hypotheses import DECIDING, paired

    runs = results("learning_yardstick.json")["runs"]
    assert all(
        r["diagnostics"]["replays"] == 0
        for t in ("reasoning", "weak_start")
        for r in runs[t]["recommended, join"]
    )
    found = {
        task: [paired(runs, task, "ExGRPO recommended", "recommended, join", column) for column in DECIDING]
        for task in ("weak_start", "reasoning")
    }
    text = {task: " and ".join(f"{m:+.1f} ± {h:.1f}" for m, h in pair) for task, pair in found.items()}
    return (
        f"against them refill ends {text['weak_start']} points higher on the weak start (at T = 1, and in "
        f"distribution at T = 0.6) and {text['reasoning']} on the reasoning task"
    )


# The runs of join on the one-pass tasks.
_ONE_PASS_JOIN = (
    "python benchmarks/learning_yardstick.py --jobs 2 --resume --tasks reasoning weak_start"
    + ' --variants "recommended, join"'
)
# (the command that writes the results file, the README's text rendered from the file)
FROM_RESULTS: list[tuple[str, Callable[[], str]]] = [
    ("python benchmarks/resume_exact.py", _resume_cases),
    ("python benchmarks/checkpoint_kill.py", _kill_trials),
    ("python benchmarks/learning.py --jobs 2", _learning_headline),
    ("python benchmarks/learning.py --jobs 2 --tasks reasoning", _quickstart_seeds),
    ("python benchmarks/learning_yardstick.py --jobs 2 --tasks reasoning", _yardstick_headline),
    ("python benchmarks/hypotheses.py", _per_fresh_question),
    ("python benchmarks/hypotheses.py", _refill),
    ("python benchmarks/hypotheses.py", _join),
    ("python benchmarks/hypotheses.py", _exact_paper),
    (_ONE_PASS_JOIN, _replay_on_one_pass),
]

# (the command, a pattern of the sentence whose numbers it produces)
BESIDE: list[tuple[str, str]] = [
    (
        "python scripts/check_quickstart.py",
        r"went\s+from\s+\*\*[0-9.]+ to [0-9.]+\*\*, best [0-9.]+ at step \d+",
    ),
]

# Numbers that name something rather than measure it.
NOT_MEASUREMENTS = {"2510.02245": "the paper's arXiv id"}

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


def test_every_number_in_the_readme_has_a_source():
    sourced = [render() for _, render in FROM_RESULTS]
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
    # The sentences: the portable kernels' run, then the plain command's on this project's machine, which the
    # printed output shows (scripts/check_quickstart.py reads them in this order).
    _, claim = re.finditer(r"went\s+from\s+\*\*(?P<start>[0-9.]+) to (?P<final>[0-9.]+)\*\*", text)
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

"""scripts/check_quickstart.py reads one quickstart sentence from each page: the portable kernels' from
docs/getting-started.md (beside the command that checks it), this project's machine's from the README."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def check_quickstart():
    spec = importlib.util.spec_from_file_location(
        "check_quickstart", ROOT / "scripts" / "check_quickstart.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("native", [False, True])
def test_each_page_has_the_sentence_the_script_checks(check_quickstart, native):
    claim = check_quickstart.claim(native)
    assert set(claim) == {"start", "final", "best", "step"} and 0 <= claim["start"] <= 1


def test_the_portable_kernels_sentence_sits_beside_its_command():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    (paragraph,) = [p for p in page.split("\n\n") if re.search(r"went\s+from\s+\*\*", p)]
    assert "`python scripts/check_quickstart.py`" in paragraph
    assert "`ATEN_CPU_CAPABILITY=default exgrpo fit --config configs/quickstart.yaml`" in paragraph


def test_a_page_without_its_sentence_is_an_error_naming_it(check_quickstart, tmp_path, monkeypatch):
    empty = tmp_path / "getting-started.md"
    empty.write_text("# Getting started\n")
    monkeypatch.setitem(check_quickstart.PAGES, False, empty)
    with pytest.raises(SystemExit, match="getting-started.md should have one"):
        check_quickstart.claim(False)

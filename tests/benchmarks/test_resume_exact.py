"""Where resume_exact.py stops and resumes each case: between two batches, in Lightning's steps (optimizer
updates), whatever the number of updates a batch takes."""

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from resume_exact import batches_per_epoch, case_steps  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "configs"


def test_one_update_a_batch_stops_at_the_documented_steps():
    config = {"model": {}, "trainer": {"val_check_interval": 50}}
    stops, horizons = case_steps(config, batches=56, steps=60)
    assert stops == {"mid": 30, "kill": 50, "end": 56}
    assert horizons == {"mid": 60, "kill": 60, "end": 60}


def test_two_updates_a_batch_stop_between_batches_and_kill_after_the_first_validation():
    config = {"model": {"steps_per_generation": 2}, "trainer": {"val_check_interval": 50}}
    stops, horizons = case_steps(config, batches=56, steps=62)
    # step 31 would fall between a batch's two updates; validation runs after batch 50, i.e. step 100
    assert stops == {"mid": 30, "kill": 100, "end": 112}
    assert horizons == {"mid": 62, "kill": 110, "end": 120}


def test_the_paper_preset_counts_its_updates():
    path = CONFIGS / "exgrpo_paper.yaml"
    stops, horizons = case_steps(yaml.safe_load(path.read_text()), batches_per_epoch(path), steps=60)
    assert stops["kill"] == 100 and stops["end"] == 2 * batches_per_epoch(path)
    assert all(stop % 2 == 0 for stop in stops.values()) and horizons["kill"] > stops["kill"]

"""Run folders named after the config and the seed, numbered when the name is taken."""

import pytest

from exgrpo_pl.run_names import free_version, run_name, safe_name


def test_a_run_is_named_after_its_config_files_and_seed():
    assert run_name(["configs/exgrpo.yaml"], 0) == "exgrpo-s0"
    assert run_name(["configs/grpo_baseline.yaml"], 3) == "grpo_baseline-s3"
    assert run_name(["base.yaml", "/tmp/lr high.yaml"], 1) == "base+lr_high-s1"
    assert run_name([], 0) == "run-s0" and run_name([], None) == "run"


def test_a_taken_name_keeps_its_name_with_a_number(tmp_path):
    assert free_version(tmp_path / "absent", "exgrpo-s0") == "exgrpo-s0"
    (tmp_path / "exgrpo-s0").mkdir()
    assert free_version(tmp_path, "exgrpo-s0") == "exgrpo-s0-v1"
    (tmp_path / "exgrpo-s0-v1").mkdir()
    assert free_version(tmp_path, "exgrpo-s0") == "exgrpo-s0-v2"
    assert free_version(tmp_path, "grpo_baseline-s0") == "grpo_baseline-s0"


def test_a_name_given_becomes_a_folder_name_or_a_clear_error():
    assert safe_name("my run/2") == "my_run_2"
    with pytest.raises(ValueError, match=r"run_name='\.\.'"):
        safe_name("..")

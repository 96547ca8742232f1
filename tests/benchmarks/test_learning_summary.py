"""The learning benchmark's variants, and its summary: exact small cases for what its docs tables are made
of."""

import sys
from pathlib import Path

import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import learning  # noqa: E402
from learning import ROOT, VARIANTS, markdown_table, presets_table, summarise  # noqa: E402
from test_buffer import make_batch  # noqa: E402

from exgrpo_pl.callbacks import ReplayCallback, replay_checks
from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.contract import Experience
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule


def make_run(seed: int, final: float, replays: int = 0) -> dict:
    curve = [(0, 0.0, 0.3), (10, 1000.0 + seed, final)]
    diagnostics = {"replays": replays, "distinct_questions": replays // 2, "max_replays_per_question": 2}
    return {"seed": seed, "commit": "abc", "curve": curve, "diagnostics": diagnostics}


def test_vs_grpo_pairs_the_seeds_both_ran():
    runs = {
        "GRPO": [make_run(0, 0.50), make_run(1, 0.60)],
        # seed 2 has no GRPO run to pair with: left out of the difference, kept in the variant's own mean
        "ExGRPO paper": [make_run(1, 0.57, 40), make_run(0, 0.52, 40), make_run(2, 0.90, 40)],
    }
    rows = summarise({"reasoning": runs})["reasoning"]["variants"]
    assert rows["GRPO"]["vs_grpo_points"] is None
    mean, half = rows["ExGRPO paper"]["vs_grpo_points"]
    spread = stats.tstd([2.0, -3.0]) / 2**0.5  # differences +2 (seed 0) and -3 (seed 1) points
    assert mean == pytest.approx(-0.5) and half == pytest.approx(stats.t.ppf(0.975, 1) * spread)
    assert rows["ExGRPO paper"]["final"][0] == pytest.approx((0.57 + 0.52 + 0.90) / 3)
    assert rows["ExGRPO paper"]["replays"] == (40, 0.0)


def test_an_ablation_is_also_paired_with_the_full_method_it_was_measured_on():
    runs = {
        "GRPO": [make_run(0, 0.50), make_run(1, 0.60)],
        "ExGRPO paper": [make_run(0, 0.30, 40), make_run(1, 0.30, 40)],
        "paper, before exact": [make_run(0, 0.52, 40), make_run(1, 0.57, 40)],
        "rho 0.75": [make_run(0, 0.47, 60), make_run(1, 0.56, 60)],
    }
    rows = summarise({"reasoning": runs})["reasoning"]["variants"]
    assert rows["ExGRPO paper"]["vs_full_points"] is None and rows["GRPO"]["vs_full_points"] is None
    mean, half = rows["rho 0.75"]["vs_full_points"]  # -5 (seed 0) and -1 (seed 1) points
    assert mean == pytest.approx(-3.0) and half == pytest.approx(stats.t.ppf(0.975, 1) * 2.0)


def test_markdown_table_lists_variants_in_the_benchmarks_order_with_the_papers_numbers():
    runs = {
        "rho 0.25": [make_run(0, 0.55, 20)],
        "ExGRPO paper": [make_run(0, 0.52, 40)],
        "paper, before exact": [make_run(0, 0.52, 40)],
        "GRPO": [make_run(0, 0.5)],
    }
    table = markdown_table(summarise({"arithmetic": runs})["arithmetic"]["variants"]).splitlines()
    order = ["| GRPO", "| ExGRPO paper", "| rho 0.25", "| paper, before exact"]
    assert [row.split(" | ")[0] for row in table[2:]] == order
    assert table[2] == "| GRPO | 1 | 0.500 ± 0.000 | — | — | 0.0 ± 0.0 | 0.500 ± 0.000 | 45.3 | — | — |"
    assert table[3] == (
        "| ExGRPO paper | 1 | 0.520 ± 0.000 | +2.0 ± 0.0 | — | 0.0 ± 0.0 | 0.520 ± 0.000 | 48.3, +3.0"
        " | 40 (20) | 2 |"
    )
    assert table[4] == (
        "| rho 0.25 | 1 | 0.550 ± 0.000 | +5.0 ± 0.0 | +3.0 ± 0.0 | 0.0 ± 0.0 | 0.550 ± 0.000 | 46.4, +1.1,"
        " -1.9 | 20 (10) | 2 |"
    )


def test_the_presets_table_has_a_row_per_task_that_ran_every_preset():
    presets = {
        "GRPO": [make_run(0, 0.50), make_run(1, 0.60)],
        "ExGRPO paper": [make_run(0, 0.40, 40)],
        "ExGRPO swap": [make_run(0, 0.45, 40), make_run(1, 0.55, 40)],
        "ExGRPO recommended": [make_run(0, 0.52, 20), make_run(1, 0.60, 20)],
    }
    partial = {name: presets[name] for name in ("GRPO", "ExGRPO paper")}
    table = presets_table(summarise({"small_pool": presets, "arithmetic": partial})).splitlines()
    assert len(table) == 3  # arithmetic lacks two presets: no row
    assert table[2].startswith("| small_pool | 0.550 ± ")
    assert "| 0.400 ± 0.000 (1 of 2 seeds) |" in table[2]  # fewer seeds than the others: said
    assert table[2].endswith("| +1.0 ± 12.7 | 0.0 ± 0.0 |")  # +2 and 0 points, paired by seed


def test_below_best_is_how_far_each_run_ended_under_its_own_best():
    collapsing = make_run(0, 0.40, 10)
    collapsing["curve"].insert(1, (5, 500.0, 0.60))  # peaked at 0.60, ended at 0.40
    rows = summarise({"small_pool": {"ExGRPO paper": [collapsing, make_run(1, 0.70, 10)]}})
    mean, _ = rows["small_pool"]["variants"]["ExGRPO paper"]["below_best_points"]
    assert mean == pytest.approx((20.0 + 0.0) / 2)


def test_a_variant_of_the_seed_preset_is_paired_with_the_seed_preset():
    runs = {
        "ExGRPO paper": [make_run(0, 0.40, 40)],
        "ExGRPO swap": [make_run(0, 0.50, 40)],
        "swap, retire from buffer and stream": [make_run(0, 0.53, 40)],
        "paper, before exact": [make_run(0, 0.44, 40)],
        "paper, retire from buffer": [make_run(0, 0.46, 40)],
    }
    rows = summarise({"small_pool": runs})["small_pool"]["variants"]
    assert rows["swap, retire from buffer and stream"]["vs_full_points"][0] == pytest.approx(3.0)
    # The paper preset's variants were measured on it before it was made exact: paired with that preset.
    assert rows["paper, retire from buffer"]["vs_full_points"][0] == pytest.approx(2.0)
    assert rows["paper, before exact"]["vs_full_points"][0] == pytest.approx(4.0)


def test_the_no_replay_variant_is_the_paper_presets_module_before_exact_without_its_replay_callback():
    args = ["--config", str(ROOT / "configs" / "exgrpo_paper.yaml"), "--trainer.logger=false"]
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    assert any(isinstance(c, ReplayCallback) for c in cli.trainer.callbacks)
    preset, change, _ = VARIANTS["paper preset, no replay"]
    change(cli)
    assert preset == "exgrpo_paper" and not any(isinstance(c, ReplayCallback) for c in cli.trainer.callbacks)
    assert cli.model.hparams.scale_rewards == "none" and cli.model.hparams.off_policy_correction == "shaping"
    # as it was measured: the paper preset before it was made exact
    assert cli.model.hparams.loss_type == "dapo" and cli.model.updates_per_batch == 1


def test_only_the_runs_the_diagnostics_plots_draw_keep_their_record_of_replays():
    def recorded(seed: int) -> dict:
        run = make_run(seed, 0.5, 4)
        run["diagnostics"]["replayed"] = [(1, 7, ["add"])]
        return run

    runs = {"ExGRPO paper": [recorded(1), recorded(0)], "rho 0.25": [recorded(0)]}
    saved = learning._without_replay_records({"reasoning": runs})["reasoning"]
    kept = {(name, r["seed"]) for name, rs in saved.items() for r in rs if "replayed" in r["diagnostics"]}
    assert kept == {("ExGRPO paper", 0)}
    assert all(r["diagnostics"]["replays"] == 4 for rs in saved.values() for r in rs)  # summaries stay


def test_completion_lengths_are_summarised_only_when_every_run_recorded_them():
    runs = [make_run(0, 0.5, 10), make_run(1, 0.6, 10)]
    runs[0]["diagnostics"]["completion_tokens"] = {"replayed": 3.0, "fresh_correct": 2.0}
    row = summarise({"arithmetic": {"ExGRPO paper": runs}})["arithmetic"]["variants"]["ExGRPO paper"]
    assert row["replayed_tokens"] is None  # seed 1 ran before the diagnostic existed
    runs[1]["diagnostics"]["completion_tokens"] = {"replayed": 5.0, "fresh_correct": 2.0}
    row = summarise({"arithmetic": {"ExGRPO paper": runs}})["arithmetic"]["variants"]["ExGRPO paper"]
    assert row["replayed_tokens"][0] == 4.0 and row["fresh_correct_tokens"] == (2.0, 0.0)


def _built(variant: str):
    """The CLI objects of `variant` (its preset with its change), built but not trained."""
    preset, change, _ = VARIANTS[variant]
    args = ["--config", str(ROOT / "configs" / f"{preset}.yaml"), "--trainer.logger=false"]
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    if change is not None:
        change(cli)
    return cli


def test_the_small_pool_task_is_the_reasoning_task_on_1000_training_questions():
    overlay = learning.task_overlay("small_pool")
    reasoning = learning.task_overlay("reasoning")
    assert overlay["model"] == reasoning["model"] and overlay["trainer"] == reasoning["trainer"]
    task = overlay["data"]["synthetic"]["init_args"]
    assert task["num_questions"] == 1500 and overlay["data"]["val_fraction"] == pytest.approx(1 / 3)
    assert overlay["data"]["batch_size"] * overlay["trainer"]["max_steps"] / 1000 == pytest.approx(9.6)


def test_the_retirement_and_demand_variants_change_what_they_say():
    callback = learning._replay_callback(_built("paper, retire from buffer, bounded demand"))
    assert callback.buffer.bucketer.retire_from == "buffer" and callback.bounded_demand
    swap = learning._replay_callback(_built("ExGRPO swap"))
    assert swap.buffer.bucketer.retire_from == "buffer" and swap.mode == "swap" and not swap.bounded_demand
    paper_way = learning._replay_callback(_built("swap, retire from buffer and stream"))
    assert paper_way.buffer.bucketer.retire_from == "buffer_and_stream" and paper_way.mode == "swap"
    paper = learning._replay_callback(_built("ExGRPO paper"))
    assert paper.buffer.bucketer.retire_from == "buffer_and_stream" and not paper.bounded_demand


def test_the_weak_start_task_is_the_reasoning_task_from_the_weaker_policy():
    overlay, reasoning = learning.task_overlay("weak_start"), learning.task_overlay("reasoning")
    assert overlay["model"].pop("model_name_or_path") == "embedded:tiny-reasoning-weak"
    reasoning["model"].pop("model_name_or_path")
    assert overlay == reasoning


def test_a_curve_is_read_at_equal_fresh_questions_between_validations():
    run = make_run(0, 0.50)
    run["fresh_questions"] = [(0, 0), (320, 320)]
    assert learning.at_fresh_questions(run, 160) == pytest.approx(0.40)  # halfway from 0.30 to 0.50


def test_the_deferred_variants_defer():
    for name in ("paper, deferred", "recommended, deferred"):
        callback = learning._replay_callback(_built(name))
        assert callback.displaced_questions == "defer" and callback.defers and callback.mode == "mix"


@pytest.mark.parametrize("overlay, batches", [({}, 400), ({"trainer": {"max_steps": 300}}, 300)])
def test_the_paper_preset_before_and_after_exact_train_on_as_many_batches(overlay, batches):
    exact, before = _built("ExGRPO paper"), _built("paper, before exact")
    assert exact.model.updates_per_batch == 2 and before.model.updates_per_batch == 1
    hp = before.model.hparams
    assert (hp.loss_type, hp.entropy_coef, hp.clip_after_replay_starts) == ("dapo", 0.001, True)
    assert (hp.entropy_token_budget, hp.skip_grad_norm, hp.weight_decay) == (None, None, 0.0)
    hp = exact.model.hparams
    assert (hp.loss_type, hp.entropy_coef, hp.clip_after_replay_starts) == ("dr_grpo", 1.5625e-5, False)
    assert (hp.entropy_token_budget, hp.skip_grad_norm, hp.weight_decay) == (32768, 500.0, 0.01)
    fills = [learning._replay_callback(cli) for cli in (exact, before)]
    assert [(c.fill_from, c.min_buffer_size) for c in fills] == [("replay_start", 1), ("start", 8)]
    rules = [learning._replay_callback(cli).buffer.bucketer.all_wrong_groups for cli in (exact, before)]
    assert rules == ["keep_last", "count"]
    for cli in (exact, before):
        if overlay:  # as the CLI lays a task's overlay over the preset
            cli.trainer.fit_loop.epoch_loop.max_steps = overlay["trainer"]["max_steps"]
        learning.train_for_batches(cli, overlay, shipped_updates=2)
        assert cli.trainer.max_steps == batches * cli.model.updates_per_batch


@pytest.mark.parametrize(
    "variant, differs",
    [
        ("no question selection", {"replay.question_sampling": "uniform"}),
        ("highest entropy", {"replay.trajectory_selection": "highest_entropy"}),
        ("no policy shaping", {"off_policy_correction": "none"}),
        ("rho 0.25", {"mix_fraction": 0.25}),
        ("paper, retire from buffer", {"buffer.bucketer.retire_from": "buffer"}),
        ("paper, deferred", {"displaced_questions": "defer"}),
    ],
)
def test_the_paper_presets_variants_are_the_preset_before_exact_with_their_one_change(variant, differs):
    def settings(cli) -> dict:
        hp = cli.model.hparams
        return {
            **replay_checks.options(learning._replay_callback(cli)),
            **{key: hp[key] for key in ("loss_type", "entropy_coef", "off_policy_correction")},
            "updates_per_batch": cli.model.updates_per_batch,
        }

    before = settings(_built("paper, before exact"))
    assert before["buffer.bucketer.all_wrong_groups"] == "count" and before["updates_per_batch"] == 1
    assert settings(_built(variant)) == {**before, **differs}
    assert VARIANTS[variant][1].full_method == "paper, before exact"


def test_the_placement_variants_are_the_recommended_preset_with_that_placement():
    recommended = replay_checks.options(learning._replay_callback(_built("ExGRPO recommended")))
    assert recommended["placement"] == "refill"
    for placement in ("join", "displace"):
        options = replay_checks.options(learning._replay_callback(_built(f"recommended, {placement}")))
        assert options == {**recommended, "placement": placement}
    # Deferring needs displaced questions: the recommended preset's deferred variant displaces them.
    deferred = replay_checks.options(learning._replay_callback(_built("recommended, deferred")))
    assert deferred == {**recommended, "placement": "displace", "displaced_questions": "defer"}
    official = replay_checks.options(
        learning._replay_callback(_built("recommended, official trajectory pick"))
    )
    assert official == {**recommended, "replay.trajectory_selection": "official_inverted_mask_entropy"}


def test_fresh_questions_count_joined_ones_and_those_that_gave_way_but_not_displaced_or_refilled_ones():
    # Groups of 2: question 1 fresh, 2 joined (its stored row first), 3 replayed (displaced or refilled).
    rollouts = make_batch([1, 1, 2, 2, 3, 3], [1.0] * 6, replayed=[False, False, True, False, True, False])
    rollouts.group_size = 2
    assert learning.fresh_questions(rollouts) == {1}
    again = make_batch([3, 3, 3, 3], [1.0] * 4, replayed=[True, False, False, False])
    again.group_size = 2  # question 3 replayed in one group and fresh in the other (a batch question)
    assert learning.fresh_questions(again) == {3}
    stored = rollouts.select([2])
    assert learning.fresh_questions(rollouts, Experience("mix", stored, "join")) == {1, 2}
    assert learning.fresh_questions(rollouts, Experience("mix", stored, "displace")) == {1}
    gave_way = make_batch([4, 4], [0.0, 0.0])
    assert learning.fresh_questions(rollouts, Experience("mix", stored, "refill"), gave_way) == {1, 4}

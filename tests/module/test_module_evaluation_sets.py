"""Named evaluation sets in real Trainer runs on a tiny model: each set sampled k times per problem (its
file's repeats, or its own num_samples), the paper's metrics logged as val/<set>/<metric> with per-domain rows
and the ID/OOD averages, and `exgrpo test` printing and writing the table."""

import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import VERL, tiny_module
from lightning.pytorch import Trainer, seed_everything

from exgrpo_pl.cli import main
from exgrpo_pl.data import ArithmeticTask, EvalSet, PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import RewardBySource

CONFIGS = Path(__file__).parents[2] / "configs"


class FirstCharacter:
    """Correct when a completion starts with the answer's first character; records every score by prompt,
    and extracts the first character as the answer (for maj@k)."""

    def __init__(self):
        self.scores = defaultdict(list)

    def __call__(self, prompts, completions, answer, **columns):
        scores = [float(c[:1] == a[:1]) for c, a in zip(completions, answer)]
        for prompt, score in zip(prompts, scores):
            self.scores[prompt].append(score)
        return scores

    def extract_answer(self, completion):
        return completion[:1] or None


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def sets(tmp_path):
    """A file set repeating each of its 3 problems 3 times (mixing two domains), and an out-of-distribution
    synthetic set sampled twice per problem."""
    problems = [("1+2=", "3", "small"), ("4+4=", "8", "small"), ("10+20=", "30", "large")]
    rows = [{"prompt": p, "answer": a, "source": d} for p, a, d in problems for _ in range(3)]
    repeated = EvalSet(path=write_rows(tmp_path / "rep.jsonl", rows), domain_column="source")
    ood = EvalSet(synthetic=ArithmeticTask(num_questions=6, seed=5), num_samples=2, out_of_distribution=True)
    return {"rep": repeated, "ood": ood}


def validate(tmp_path, model_dir, sets, reward, **module_options):
    seed_everything(0)
    module = tiny_module(model_dir, reward_funcs=[reward], **module_options)
    data = PromptDataModule(
        synthetic=ArithmeticTask(num_questions=64, seed=1), val_fraction=0.0, eval_sets=sets, batch_size=4
    )
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.validate(module, datamodule=data, verbose=False)
    return module, data, {name: float(value) for name, value in trainer.callback_metrics.items()}


def test_each_set_is_sampled_k_times_per_problem_and_scored_exactly(tmp_path, tiny_model_dir, sets):
    reward = FirstCharacter()
    module, data, metrics = validate(tmp_path, tiny_model_dir, sets, reward)
    assert data.val_set_names == ["rep", "ood"] and data.out_of_distribution_sets == {"ood"}
    rep = {row["prompt"]: row["num_samples"] for row in data.eval_rows["rep"]}
    assert rep == {"1+2=": 3, "4+4=": 3, "10+20=": 3}  # repeated rows count as samples, none dropped
    assert {len(reward.scores[p]) for p in rep} == {3}
    assert {len(reward.scores[row["prompt"]]) for row in data.eval_rows["ood"]} == {2}

    def mean(values):
        return sum(values) / len(values)

    expected_rep = mean([mean(reward.scores[p]) for p in rep])
    assert metrics["val/rep/avg@3"] == pytest.approx(expected_rep)
    assert metrics["val/rep/score"] == pytest.approx(expected_rep)
    assert metrics["val/rep/samples"] == 9 and metrics["val/rep/problems"] == 3
    assert metrics["val/rep/pass@3"] == pytest.approx(mean([float(max(reward.scores[p])) for p in rep]))
    assert 0.0 <= metrics["val/rep/maj@3"] <= 1.0 and "val/rep/greedy_pass@1" not in metrics
    small = ["1+2=", "4+4="]
    assert metrics["val/rep/small/avg@3"] == pytest.approx(mean([mean(reward.scores[p]) for p in small]))
    assert metrics["val/rep/large/problems"] == 1
    expected_ood = mean([mean(reward.scores[row["prompt"]]) for row in data.eval_rows["ood"]])
    assert metrics["val/ood/avg@2"] == pytest.approx(expected_ood)
    assert metrics["val/average_id/score"] == pytest.approx(expected_rep)
    assert metrics["val/average_ood/score"] == pytest.approx(expected_ood)
    assert metrics["val/average/score"] == pytest.approx((expected_rep + expected_ood) / 2)
    families = {f"ood/{row['domain']}" for row in data.eval_rows["ood"]}  # the task's families are domains
    assert set(module.last_evaluation_table["rows"]) == {"rep", "rep/small", "rep/large", "ood", *families}


def test_greedy_pass_at_1_samples_one_more_completion_per_problem(tmp_path, tiny_model_dir, sets):
    reward = FirstCharacter()
    _, data, metrics = validate(tmp_path, tiny_model_dir, {"rep": sets["rep"]}, reward, val_greedy=True)
    assert {len(reward.scores[row["prompt"]]) for row in data.eval_rows["rep"]} == {4}
    assert 0.0 <= metrics["val/rep/greedy_pass@1"] <= 1.0


def test_a_reward_by_source_gives_maj_at_k_with_each_sources_answers(tmp_path, tiny_model_dir, sets):
    # configs/eval_paper.yaml's layout: RewardBySource is the first reward function.
    by_source = RewardBySource({"small": FirstCharacter(), "large": FirstCharacter()})
    module, _, metrics = validate(tmp_path, tiny_model_dir, {"rep": sets["rep"]}, by_source)
    assert 0.0 <= metrics["val/rep/maj@3"] <= 1.0 and 0.0 <= metrics["val/rep/large/maj@3"] <= 1.0
    assert "maj@3" in module.last_evaluation_table["rows"]["rep/small"]


def test_a_problem_under_two_domains_is_sampled_and_reported_in_each(tmp_path, tiny_model_dir):
    problems = [("1+2=", "small")] * 2 + [("1+2=", "large"), ("10+20=", "large")]
    rows = [{"prompt": p, "answer": str(eval(p[:-1])), "source": d} for p, d in problems]
    shared = EvalSet(path=write_rows(tmp_path / "shared.jsonl", rows), domain_column="source")
    reward = FirstCharacter()
    with pytest.warns(UserWarning, match="appear under several domains"):
        _, _, metrics = validate(tmp_path, tiny_model_dir, {"s": shared}, reward)
    assert len(reward.scores["1+2="]) == 2 + 1  # its two rows in one domain, its one row in the other
    assert metrics["val/s/small/problems"] == 1 and metrics["val/s/small/samples"] == 2
    assert metrics["val/s/large/problems"] == 2 and metrics["val/s/large/samples"] == 2


def test_a_set_of_one_domain_averaged_by_domain_keeps_its_average(tmp_path, tiny_model_dir, sets):
    rows = [
        {"prompt": "1+2=", "answer": "3", "source": "aime"},
        {"prompt": "4+4=", "answer": "8", "source": "aime"},
    ]
    one = EvalSet(
        path=write_rows(tmp_path / "one.jsonl", rows), domain_column="source", average_by_domain=True
    )
    _, _, metrics = validate(tmp_path, tiny_model_dir, {"one": one}, FirstCharacter())
    assert metrics["val/average/score"] == metrics["val/one/avg@1"]
    assert metrics["val/average_id/score"] == metrics["val/one/avg@1"]


def test_the_plain_validation_set_keeps_its_pass_at_1_next_to_named_sets(tmp_path, tiny_model_dir, sets):
    seed_everything(0)
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), eval_sets=sets, batch_size=4)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.validate(tiny_module(tiny_model_dir), datamodule=data, verbose=False)
    metrics = trainer.callback_metrics
    assert data.val_set_names == [None, "rep", "ood"]
    assert "val/pass@1" in metrics and "val/rep/avg@3" in metrics


def test_a_held_out_set_is_the_validation_split_with_its_own_k(tmp_path, tiny_model_dir):
    data = PromptDataModule(
        synthetic=ArithmeticTask(num_questions=64, seed=1), eval_sets={"held_out": EvalSet(num_samples=2)}
    )
    data.setup()
    assert [row["id"] for row in data.eval_rows["held_out"]] == [row["id"] for row in data.val_rows]
    assert {row["num_samples"] for row in data.eval_rows["held_out"]} == {2}


@pytest.mark.parametrize("name", ["a/b", "", "average"])
def test_a_set_name_that_cannot_be_a_metric_path_is_an_error(name):
    with pytest.raises(ValueError, match="cannot name a set"):
        PromptDataModule(eval_sets={name: EvalSet()})


def test_exgrpo_test_prints_the_table_and_writes_it_next_to_the_logs(tmp_path, tiny_model_dir, sets, capsys):
    path = sets["rep"].path
    eval_sets = (
        f"{{rep: {{path: {path}, domain_column: source}}, ood: {{synthetic: {{class_path: "
        "exgrpo_pl.data.ArithmeticTask, init_args: {num_questions: 4}}, out_of_distribution: true}}"
    )
    main([
        "test", f"--model.model_name_or_path={tiny_model_dir}", "--model.max_completion_length=3",
        "--data.synthetic=exgrpo_pl.data.ArithmeticTask", "--data.synthetic.num_questions=40",
        "--data.val_fraction=0", f"--data.eval_sets={eval_sets}", "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "| set | score | avg@1 |" in out and "| average (out-of-distribution) |" in out
    (written,) = tmp_path.glob("lightning_logs/*/test.json")
    table = json.loads(written.read_text())
    assert {"rep", "rep/small", "rep/large", "ood"} <= set(table["rows"])
    assert (written.parent / "test.md").read_text() in out


def test_the_papers_evaluation_config_runs_on_its_file_layout(tmp_path, verl_model_dir, monkeypatch, capsys):
    """configs/eval_paper.yaml as shipped, on files laid out as the paper's (its data/ paths, verl rows, the
    AIME problems repeated), with a tiny model on the CPU: every set reported, and the in-distribution
    average over the mixed file's benchmarks."""
    rows = pq.read_table(VERL).to_pylist()
    in_distribution = [row for row in rows for _ in range(4 if row["data_source"] == "aime24" else 1)]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(in_distribution), tmp_path / "data" / "test.id.parquet")
    for name, source in [("arc_c", "arc_c"), ("gpqa", "gpqa"), ("mmlu_pro", "mmlu_pro")]:
        choices = [{**row, "data_source": source, "reward_model": {"ground_truth": "A", "style": "rule"}}
                   for row in rows[:2]]  # fmt: skip
        pq.write_table(pa.Table.from_pylist(choices), tmp_path / "data" / f"valid.{name}.parquet")
    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where exgrpo runs
    main([
        "test", "--config", str(CONFIGS / "eval_paper.yaml"), f"--model.model_name_or_path={verl_model_dir}",
        "--model.chat_template=false", "--model.dtype=float32", "--model.attn_implementation=eager",
        "--model.max_completion_length=3", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
        "--data.synthetic=exgrpo_pl.data.ArithmeticTask", "--data.synthetic.num_questions=40",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ])  # fmt: skip
    out = capsys.readouterr().out
    (written,) = tmp_path.glob("lightning_logs/*/test.json")
    table = json.loads(written.read_text())
    assert table["rows"]["in_distribution/aime24"]["problems"] == 3
    assert "avg@4" in table["rows"]["in_distribution/aime24"] and "avg@1" in table["rows"]["arc_c"]
    domains = [f"in_distribution/{source}" for source in ("aime24", "amc23", "math500", "gsm8k")]
    expected = sum(table["rows"][name]["score"] for name in domains) / 4
    assert table["averages"]["in-distribution"] == pytest.approx(expected)
    assert {"arc_c", "gpqa_diamond", "mmlu_pro"} <= set(table["rows"]) and "| average (all) |" in out


class WritesTable(ExGRPOModule):
    """Writes each rank's evaluation table to `<out_dir>/rank<r>.json`."""

    def __init__(self, out_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(self.last_evaluation_table))


@pytest.mark.multiprocess
def test_two_ranks_score_their_shares_and_count_each_problem_once(tmp_path, tiny_model_dir):
    settings = tiny_module(tiny_model_dir).hparams
    module = WritesTable(str(tmp_path), **settings)
    # 7 problems over 2 ranks: the distributed sampler gives one rank a repeat of a problem to even them out.
    sets = {"odd": EvalSet(synthetic=ArithmeticTask(num_questions=7, seed=3), num_samples=2)}
    data = PromptDataModule(
        synthetic=ArithmeticTask(40, seed=1), val_fraction=0.0, eval_sets=sets, batch_size=2, val_batch_size=2
    )
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.validate(module, datamodule=data, verbose=False)
    tables = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert tables[0] == tables[1]  # every rank holds the gathered result
    assert tables[0]["rows"]["odd"]["problems"] == 7 and tables[0]["rows"]["odd"]["samples"] == 14

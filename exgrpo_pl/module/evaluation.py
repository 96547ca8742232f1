"""ExGRPOModule's evaluation: validation and test pass@1 of the validation set, the paper's metrics on named
evaluation sets (`PromptDataModule(eval_sets=...)`), and the validation pass@1 measured before the first
update (`validate_at_start`), each sampled on a generator of its own so that it never changes what training
samples.

A named set's problems are sampled k times each (the set's `num_samples`, or as often as the problem's row
repeats in its file), plus one greedy completion with `val_greedy`; maj@k is reported where the first
reward function extracts answers (`extract_answer(completion_text) -> str | None`, as every shipped verifier
does; one that takes `**columns` also gets the row's dataset columns, as `RewardBySource`'s does, which asks
the function of the row's source). Each rank keeps one `ProblemSamples` per problem; at the end of the
evaluation they are gathered, every problem counted once (a distributed sampler pads a rank's share with
repeats), and `exgrpo_pl.evaluation` turns them into `<stage>/<set>/<metric>`,
`<stage>/<set>/<domain>/<metric>` where a set mixes domains, and the averages of the sets' headline avg@k
(`<stage>/average/score`, `/average_id/score`, `/average_ood/score`). The table is kept as
`last_evaluation_table` for `exgrpo validate` and `exgrpo test` to print and write.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader, rank_zero_info
from torch import Tensor
from torchmetrics import MeanMetric

from exgrpo_pl.evaluation import ProblemSamples, summarize
from exgrpo_pl.evaluation.report import build_table
from exgrpo_pl.evaluation.samples import clipped_rows, problem_samples
from exgrpo_pl.lightning_internals import batches_that_stepped
from exgrpo_pl.module.validation_curve import log_curve
from exgrpo_pl.rewards.by_source import extract_answer
from exgrpo_pl.seeding import derive_seed
from exgrpo_pl.step.groups import RolloutPlan, dataset_columns, plan_rollouts

# Batch keys of an evaluation set's batches that are not dataset columns for the reward functions.
_SET_KEYS = ("num_samples",)


class PassRateEvaluation:
    """Validation and test steps of `ExGRPOModule`: pass@1 of completions sampled at `val_temperature`, and
    the paper's metrics on named evaluation sets (see the module docstring).

    Reads the module's `hparams`, `_collect`, `collector`, `eos_token_ids`, `val_pass_at_1` and
    `test_pass_at_1`; the datamodule's `val_set_names` (one name per validation loader, None for the plain
    validation set) and `out_of_distribution_sets`, where it has them.
    """

    last_evaluation_table: dict | None = None
    best_val_pass_at_1 = 0.0  # the best validation pass@1 so far, the start's included (val/best_pass@1)
    # (logging step, validation pass@1) of every validation so far, the start's included: val/pass@1_curve
    val_curve: tuple[tuple[int, float], ...] = ()

    def _pass_rate(self, batch: dict, batch_idx: int) -> Tensor:
        """`[B * n]` 1.0 where a completion sampled at `val_temperature` is correct, n per prompt.

        Validation samples from a generator of its own (forked from, and restored into, the global one), so
        how often a run validates never changes what its training steps sample.
        """
        hp = self.hparams
        temperature = hp.temperature if hp.val_temperature is None else hp.val_temperature
        plan = plan_rollouts(batch, hp.val_num_generations)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed("validation", self.global_step, batch_idx))
            rollouts, _ = self._collect(plan, temperature)
        return rollouts.correct.float()

    def _evaluate(
        self, batch: dict, batch_idx: int, dataloader_idx: int, metric: MeanMetric, name: str
    ) -> None:
        """A validation or test step: pass@1 of the plain set into `metric`, logged as `name`; a named set's
        problems kept for `_log_sets`."""
        set_name = self._set_name(dataloader_idx)
        if set_name is not None:
            self._sample_set(batch, batch_idx, set_name)
            return
        metric.update(self._pass_rate(batch, batch_idx))
        # One loader logs it, so its name needs no loader suffix when named sets have loaders of their own.
        self.log(
            name, metric, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch["prompt"]),
            add_dataloader_idx=False,
        )  # fmt: skip

    def _set_name(self, dataloader_idx: int) -> str | None:
        """The evaluation set of validation loader `dataloader_idx`; None for the plain validation set."""
        names = getattr(self.trainer.datamodule, "val_set_names", None) or [None]
        return names[dataloader_idx]

    def _sample_set(self, batch: dict, batch_idx: int, name: str) -> None:
        """Samples each problem of an evaluation set's batch k times (and greedily with `val_greedy`) and
        keeps one `ProblemSamples` per problem for `_log_sets`."""
        hp = self.hparams
        prompts = list(batch["prompt"])
        repeats = [k or hp.val_num_generations for k in batch.get("num_samples", [None] * len(prompts))]
        question_ids = torch.as_tensor(batch["question_id"], dtype=torch.long)
        columns = {key: v for key, v in dataset_columns(batch).items() if key not in _SET_KEYS}
        temperature = hp.temperature if hp.val_temperature is None else hp.val_temperature
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(f"evaluation/{name}", self.global_step, batch_idx))
            rollouts, _ = self._collect(RolloutPlan(prompts, question_ids, repeats, columns), temperature)
            greedy = None
            if hp.val_greedy:
                greedy, _ = self._collect(
                    RolloutPlan(prompts, question_ids, [1] * len(prompts), columns), 0.0
                )
        clipped = clipped_rows(rollouts, hp.max_completion_length, self.eos_token_ids)
        first = self.collector.reward_funcs[0]
        answer_of = functools.partial(extract_answer, first) if hasattr(first, "extract_answer") else None
        problems = problem_samples(
            rollouts, repeats, clipped, question_ids.tolist(), answer_of, batch.get("domain"), columns
        )
        if greedy is not None:
            for problem, correct in zip(problems, greedy.correct.tolist()):
                problem.greedy_correct = bool(correct)
        self._set_problems[name].extend(problems)

    def _log_sets(self, stage: str) -> None:
        """Logs the named sets' metrics from every rank's problems and keeps the table (see the module
        docstring). Call at the end of a validation or test epoch."""
        metrics = self._set_metrics(stage)
        if metrics:
            self.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=False, rank_zero_only=False)

    def _set_metrics(self, stage: str) -> dict[str, float]:
        """The named sets' metrics (`<stage>/<set>/<metric>` and the averages) from every rank's problems,
        which it clears, keeping the table; empty when no set was sampled. Every rank must call it."""
        problems = getattr(self, "_set_problems", None)
        if not problems:
            return {}
        self._set_problems = defaultdict(list)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, dict(problems))
        else:
            gathered = [problems]
        results = {}
        for name in sorted({name for part in gathered for name in part}):
            # A problem is its question in its domain: an evaluation file may hold one under two domains.
            unique: dict[tuple, ProblemSamples] = {}
            for part in gathered:
                for problem in part.get(name, []):
                    unique.setdefault((problem.question_id, problem.domain), problem)
            results[name] = summarize(list(unique.values()))
            domains = {problem.domain for problem in unique.values()}
            if len(domains) > 1:
                for domain in sorted(domains, key=str):
                    subset = [p for p in unique.values() if p.domain == domain]
                    results[f"{name}/{domain}"] = summarize(subset)
        data = self.trainer.datamodule
        ood = getattr(data, "out_of_distribution_sets", ())
        by_domain = getattr(data, "sets_averaged_by_domain", ())
        table = build_table(results, [n for n in ood if n in results], [n for n in by_domain if n in results])
        self.last_evaluation_table = table
        metrics = {
            f"{stage}/{row}/{metric}": value
            for row, values in table["rows"].items()
            for metric, value in values.items()
        }
        short = {"all": "average", "in-distribution": "average_id", "out-of-distribution": "average_ood"}
        metrics.update({f"{stage}/{short[group]}/score": value for group, value in table["averages"].items()})
        return metrics

    def _validate_at_start(self) -> None:
        """With `validate_at_start`, measures validation pass@1 and the named evaluation sets before the first
        update and logs them at step 0. Call in `on_train_start`."""
        # A resumed run measured its start already, and logged it at step 0.
        if not self.hparams.validate_at_start or self.trainer.datamodule is None or self.global_step > 0:
            return
        # The later validations' own loaders (sharded across ranks, limit_val_batches applied): the same
        # samples, each rank measuring its share, and the mean taken over all ranks.
        val_loop = self.trainer.fit_loop.epoch_loop.val_loop
        val_loop.setup_data()
        loaders = self.trainer.val_dataloaders
        if not loaders:  # no validation batches (limit_val_batches=0, an empty validation set)
            return
        start, plain = MeanMetric().to(self.device), False
        self._set_problems = defaultdict(list)
        for index, (loader, limit) in enumerate(zip(CombinedLoader(loaders).flattened, val_loop.max_batches)):
            name = self._set_name(index)
            plain |= name is None
            batches = itertools.islice(loader, None if math.isinf(limit) else int(limit))
            for batch_idx, batch in enumerate(batches):
                if name is None:
                    start.update(self._pass_rate(batch, batch_idx))
                else:
                    self._sample_set(batch, batch_idx, name)
        # Only the sets there are: with named sets alone (val_fraction 0) there is no plain pass@1.
        metrics = {"val/pass@1": float(start.compute())} if plain else {}
        if plain:
            self.best_val_pass_at_1 = max(self.best_val_pass_at_1, metrics["val/pass@1"])
            metrics["val/best_pass@1"] = self.best_val_pass_at_1
        metrics.update(self._set_metrics("val"))
        if self.logger is not None and metrics:
            self.logger.log_metrics(metrics, step=self.global_step)
        if plain:
            self._extend_val_curve(self.global_step, metrics["val/pass@1"])
        shown = [
            key for key in metrics if key == "val/pass@1" or (key.endswith("/score") and key.count("/") == 2)
        ]
        for key in shown:
            rank_zero_info(f"{key} before training: {metrics[key]:.3f}")

    def on_validation_start(self) -> None:
        self.val_pass_at_1.set_dtype(torch.float32)
        self._set_problems = defaultdict(list)

    def on_test_start(self) -> None:
        self.test_pass_at_1.set_dtype(torch.float32)
        self._set_problems = defaultdict(list)

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, batch_idx, dataloader_idx, self.val_pass_at_1, "val/pass@1")

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, batch_idx, dataloader_idx, self.test_pass_at_1, "test/pass@1")

    def on_validation_epoch_end(self) -> None:
        self._log_sets("val")
        if self.trainer.sanity_checking or not self.val_pass_at_1.update_called:
            return
        # compute() syncs the ranks (every rank runs this hook) and caches the value Lightning then logs.
        value = float(self.val_pass_at_1.compute())
        self.best_val_pass_at_1 = max(self.best_val_pass_at_1, value)
        self.log("val/best_pass@1", self.best_val_pass_at_1, on_step=False, on_epoch=True)
        if self.trainer.state.fn == TrainerFn.FITTING:  # on the fit's curve; `exgrpo validate` is not
            self._extend_val_curve(batches_that_stepped(self.trainer), value)

    def _extend_val_curve(self, step: int, value: float) -> None:
        """Adds a validation at logging step `step` to `val_curve` and logs the curve's picture."""
        self.val_curve = (*self.val_curve, (step, value))
        log_curve(self.trainer, list(self.val_curve), step)

    def on_test_epoch_end(self) -> None:
        self._log_sets("test")

"""GRPO vs ExGRPO (paper and swap presets, and the paper's ablations) on three embedded tasks, 5+ seeds each.

More variants, not in the paper: the paper preset without its ReplayCallback ("paper preset, no replay"),
which separates what replay does from what the preset's other settings (advantages, entropy bonus) do; and
the presets with solved questions retired from the buffer only (they stay in the fresh stream) and with the
replay demand bounded by the medium tiers' supply.

Every run is `exgrpo fit` of a shipped preset for a fixed number of steps, a step being one generated batch
(the paper's axis: its code's training steps count batches); a preset that takes several optimizer updates
per batch (the paper preset: 2, `steps_per_generation`) gets `max_steps`, which counts updates, scaled so. Its
validation curve is kept against steps and against generated tokens, so variants compare at equal steps
(the final point) and at equal generated tokens (each curve read at the budget every run reached). Replay
diagnostics are recorded on the way: which questions were replayed and how often, the questions in each
correctness bucket, and the difficulty families of the replayed questions over time. Prints tables with 95%
intervals (Student t over seeds) and the paper's ablation numbers beside them; writes JSON and PNGs to
benchmarks/results/.

    python benchmarks/learning.py --quick --jobs 2   # three presets, 2 seeds, short runs: < 10 min on 2 cores
    python benchmarks/learning.py --jobs 2           # both tasks, all variants, 5 seeds: ~2.5 h on 2 cores
    python benchmarks/learning.py --jobs 2 --resume  # finish an interrupted run (finished runs are kept)
    python benchmarks/learning.py --report           # the tables and plots again, from the results file

Tasks: "arithmetic" is the presets as shipped (`configs/*.yaml`: one-step sums, nearly every correct
completion of a question the same string); "reasoning" lays configs/quickstart_reasoning.yaml's model, data
and schedule over each preset (step-by-step derivations whose correct completions differ, so trajectory
selection has a choice); "small_pool" is "reasoning" on 1,000 training and 500 held-out questions, about 10
epochs in its 300 steps (the reference description's regime, the written description of ExGRPO that
configs/exgrpo_swap.yaml follows; the swap preset's replay starts at epoch 5); "weak_start" is "reasoning"
from a weaker policy, `embedded:tiny-reasoning-weak` (see `WEAK_START`), where correct answers are rare at
first and the replay start trigger fires late (the reference description: replay "stabilizes training on
weaker models"). Besides steps and generated tokens, each curve is kept against the fresh questions
trained on (a question's group counted each time it was trained on fresh; replayed groups and questions a
mixed step displaced are not; a question a stored row joined is, and so is one whose group of equal rewards
gave its place to refill, see `fresh_questions`), the axis on which replay's displaced questions show.
Seed s is `--seed_everything=s`: the data order, replay draws, rollout and validation samples all derive from
it, so seeds are independent runs. Each run records the commit its code came from and the machine it ran on
(`machine`: the same code and seed can train differently on another CPU or torch build). Not a timed test: a
measurement to read.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import subprocess
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
import yaml
from lightning.pytorch import Callback
from scipy import stats
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _changed(
    replay: dict | None = None,
    callback: dict | None = None,
    module: dict | None = None,
    bucketer: dict | None = None,
):
    """A variant of a preset: attributes of its SelectiveReplay, ReplayCallback, DifficultyBucketer or module
    changed."""

    def apply(cli) -> None:
        replay_callback = _replay_callback(cli)
        for target, changes in (
            (replay_callback.replay, replay),
            (replay_callback, callback),
            (replay_callback.buffer.bucketer, bucketer),
        ):
            for key, value in (changes or {}).items():
                setattr(target, key, value)
        for key, value in (module or {}).items():
            cli.model.hparams[key] = value

    return apply


def _without_replay(cli) -> None:
    """The paper preset's module (its advantages, loss and entropy bonus) without its ReplayCallback: no
    replay and no retired questions, so that the paper preset's difference from GRPO splits into what
    replay does and what the preset's other settings do."""
    cli.trainer.callbacks.remove(_replay_callback(cli))


def _dynamic_sampling(**options):
    """The preset's module, without a ReplayCallback, with dynamic sampling: `ExGRPOModule` options
    (`dynamic_sampling`, `refill_fraction`, `max_generation_rounds`). Filling dead groups with fresh questions
    and no replay: the control that tells refill's gain from replay apart from its fuller groups."""

    def apply(cli) -> None:
        replay = next((c for c in cli.trainer.callbacks if isinstance(c, ReplayCallback)), None)
        if replay is not None:
            cli.trainer.callbacks.remove(replay)
        cli.model.hparams.update(options)

    return apply


_BUFFER_ONLY = {"retire_from": "buffer"}
_KEEP_LAST, _COUNTED = {"all_wrong_groups": "keep_last"}, {"all_wrong_groups": "count"}
# The paper preset before it took the official code's loss normaliser, entropy weight, two updates per batch,
# clipping schedule, rule for all-wrong groups, skip rule, weight decay and pool timing
# (configs/exgrpo_paper.yaml says what each is).
_AS_BEFORE_EXACT = _changed(
    callback={"fill_from": "start", "min_buffer_size": 8},
    module={
        "loss_type": "dapo",
        "entropy_coef": 0.001,
        "entropy_token_budget": None,
        "steps_per_generation": 1,
        "clip_after_replay_starts": True,
        "skip_grad_norm": None,
        "weight_decay": 0.0,
    },
    bucketer=_COUNTED,
)


def _before_exact(change):
    """`change` applied to the paper preset as it was before it was made exact. Its ablations and other
    variants were measured on that preset, so they are built on it and compared with it ("vs full method":
    "paper, before exact", not the exact preset)."""

    def apply(cli) -> None:
        _AS_BEFORE_EXACT(cli)
        change(cli)

    apply.full_method = "paper, before exact"
    return apply


# name -> (preset, change applied to the built CLI objects, the variant's average accuracy in the paper's
# ablation study, arXiv 2510.02245; None: not one of its variants). The paper's ablations are built on the
# paper preset as it was before it was made exact, on which they were measured (`_before_exact`).
VARIANTS = {
    "GRPO": ("grpo_baseline", None, 45.3),
    "ExGRPO paper": ("exgrpo_paper", None, 48.3),
    "ExGRPO swap": ("exgrpo_swap", None, None),
    "ExGRPO recommended": ("exgrpo", None, None),
    "no question selection": (
        "exgrpo_paper",
        _before_exact(_changed(replay={"question_sampling": "uniform"})),
        46.7,
    ),
    "no trajectory selection": (
        "exgrpo_paper",
        _before_exact(_changed(replay={"trajectory_selection": "random"})),
        46.3,
    ),
    "highest entropy": (
        "exgrpo_paper",
        _before_exact(_changed(replay={"trajectory_selection": "highest_entropy"})),
        46.0,
    ),
    "no policy shaping": (
        "exgrpo_paper",
        _before_exact(_changed(module={"off_policy_correction": "none"})),
        41.2,
    ),
    "rho 0.25": ("exgrpo_paper", _before_exact(_changed(callback={"mix_fraction": 0.25})), 46.4),
    "rho 0.75": ("exgrpo_paper", _before_exact(_changed(callback={"mix_fraction": 0.75})), 44.8),
    "paper preset, no replay": ("exgrpo_paper", _before_exact(_without_replay), None),
    "paper, before exact": ("exgrpo_paper", _AS_BEFORE_EXACT, None),
    # Not the paper's: what a solved question leaves, and replay demand bounded by the medium supply.
    "paper, retire from buffer": ("exgrpo_paper", _before_exact(_changed(bucketer=_BUFFER_ONLY)), None),
    "paper, bounded demand": (
        "exgrpo_paper",
        _before_exact(_changed(callback={"bounded_demand": True})),
        None,
    ),
    "paper, retire from buffer, bounded demand": (
        "exgrpo_paper",
        _before_exact(_changed(bucketer=_BUFFER_ONLY, callback={"bounded_demand": True})),
        None,
    ),  # fmt: skip
    # The fresh questions a mixed step displaces come back in the following steps instead of being dropped.
    # (Deferring applies to displaced questions: the recommended preset's variant displaces, as it did.)
    "paper, deferred": (
        "exgrpo_paper",
        _before_exact(_changed(callback={"displaced_questions": "defer"})),
        None,
    ),
    "recommended, deferred": (
        "exgrpo",
        _changed(callback={"placement": "displace", "displaced_questions": "defer"}),
        None,
    ),  # fmt: skip
    # The official code's trajectory score (an inverted mask from another row, favouring short trajectories)
    # in place of the paper's lowest mean completion entropy.
    "recommended, official trajectory pick": (
        "exgrpo",
        _changed(replay={"trajectory_selection": "official_inverted_mask_entropy"}),
        None,
    ),
    # Where experience goes (ReplayCallback's placement): the recommended preset refills the places of groups
    # whose K rewards are all equal; these put it in the places of fresh questions (the paper's mix, the
    # recommended preset's placement until the learning page's H6), or join it to its own question's group.
    "recommended, displace": ("exgrpo", _changed(callback={"placement": "displace"}), None),
    "recommended, join": ("exgrpo", _changed(callback={"placement": "join"}), None),
    # Dead groups (K equal rewards) filled with fresh questions, no replay: refill's twin, the places given to
    # fresh questions instead of replayed ones (at most a quarter of the batch, as the preset's mix_fraction),
    # and DAPO's dynamic sampling on GRPO (rounds of a batch until no dead place is left, at most 10).
    "recommended, fresh refill": (
        "exgrpo",
        _dynamic_sampling(dynamic_sampling="refill", refill_fraction=0.25),
        None,
    ),
    "GRPO, dynamic sampling": ("grpo_baseline", _dynamic_sampling(dynamic_sampling="dapo"), None),
    # The paper's code skips a group with no correct rollout, so its question keeps its last bucket (the
    # paper preset's rule); "counted" is ours, the other presets'.
    "paper, all-wrong counted": ("exgrpo_paper", _changed(bucketer=_COUNTED), None),
    "recommended, all-wrong keeps last bucket": ("exgrpo", _changed(bucketer=_KEEP_LAST), None),
    # The swap preset retires from the buffer only (the bucketer's default); this variant, the paper's way.
    "swap, retire from buffer and stream": (
        "exgrpo_swap",
        _changed(bucketer={"retire_from": "buffer_and_stream"}),
        None,
    ),  # fmt: skip
}
# The full method each preset's variants are compared with, unless a variant's change names its own.
FULL_METHOD = {"exgrpo_paper": "ExGRPO paper", "exgrpo_swap": "ExGRPO swap", "exgrpo": "ExGRPO recommended"}
PAPER_GRPO, PAPER_FULL = VARIANTS["GRPO"][2], VARIANTS["ExGRPO paper"][2]
PRESETS = ("GRPO", "ExGRPO paper", "ExGRPO swap", "ExGRPO recommended")
# The curves' x axis: batches trained on, which are optimizer steps for a preset that takes one update a batch
# (the exact paper preset takes two).
BATCHES_AXIS = "batches (optimizer steps at one update a batch)"
DIAGNOSED = ("ExGRPO paper", "ExGRPO swap")  # the presets whose replays the diagnostics plots draw
TASKS = ("arithmetic", "reasoning", "small_pool", "weak_start")
# Steps of a --quick run per task (full runs take the task's own max_steps).
QUICK_STEPS = {"arithmetic": 100, "reasoning": 80, "small_pool": 80, "weak_start": 80}
# The small-pool task: the reasoning task cut to 1,000 training and 500 held-out questions, which its 300
# steps of 32 questions cover about 10 times (the reference description's regime: many epochs of one set).
SMALL_POOL = {"num_questions": 1500, "val_fraction": 1 / 3}
# The epoch the swap preset's replay starts in, per task: the reference description says "after 5-10
# epochs"; a reasoning run sees half an epoch, so there it starts on min_buffer_size alone. None: as the
# preset ships.
SWAP_START_EPOCH = {"arithmetic": None, "reasoning": None, "small_pool": 5, "weak_start": None}
# The weak-start task's policy: scripts/make_reasoning_policy.py stopped at a lower pass@1 (see there).
WEAK_START = "embedded:tiny-reasoning-weak"


def _replay_callback(cli) -> ReplayCallback:
    return next(c for c in cli.trainer.callbacks if isinstance(c, ReplayCallback))


def task_overlay(task: str) -> dict:
    """What a task changes in a preset: nothing for "arithmetic" (the presets' own task); for "reasoning"
    the model, reward, lengths, data and schedule of configs/quickstart_reasoning.yaml; "small_pool" is
    "reasoning" with `SMALL_POOL`'s question set, "weak_start" "reasoning" from the `WEAK_START` policy."""
    if task == "arithmetic":
        return {}
    config = yaml.safe_load((ROOT / "configs" / "quickstart_reasoning.yaml").read_text())
    model_keys = ("model_name_or_path", "reward_funcs", "max_completion_length", "val_num_generations")
    overlay = {
        "model": {key: config["model"][key] for key in model_keys},
        "data": config["data"],
        "trainer": {key: config["trainer"][key] for key in ("max_steps", "val_check_interval")},
    }
    if task == "small_pool":
        overlay["data"]["synthetic"]["init_args"]["num_questions"] = SMALL_POOL["num_questions"]
        overlay["data"]["val_fraction"] = SMALL_POOL["val_fraction"]
    if task == "weak_start":
        overlay["model"]["model_name_or_path"] = WEAK_START
    return overlay


class Record(Callback):
    """The validation curve [(step, generated tokens, val pass@1)] after the start, and what replay did:
    every replayed question (id and family) per step, every `every` steps the number of questions in play
    per correctness bucket (the latest group's correct count out of K; retired questions left out) and the
    numbers of retired questions and of questions out of the fresh stream, the mean length in tokens of
    the replayed completions and of the fresh correct ones, and at each validation the fresh questions
    trained on so far (`fresh`: [(counted each time, distinct)]; a group with a replayed row is not fresh)."""

    def __init__(self, every: int = 20) -> None:
        self.every = every
        self.curve: list[tuple[int, float, float]] = []
        self.replayed: list[tuple[int, list[int], list[str]]] = []
        self.buckets: list[tuple[int, list[int]]] = []
        self.retired: list[tuple[int, int, int]] = []  # (step, retired, out of the fresh stream)
        self.tokens = {"replayed": [0, 0], "fresh_correct": [0, 0]}  # [tokens, completions]
        self.fresh: list[tuple[int, int]] = []
        self._fresh_trained, self._fresh_distinct = 0, set()

    def on_validation_end(self, trainer, pl_module) -> None:
        value = float(trainer.callback_metrics["val/pass@1"])
        self.curve.append((_step(trainer, pl_module), float(pl_module.generated_tokens), value))
        self.fresh.append((self._fresh_trained, len(self._fresh_distinct)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollouts = outputs["rollouts"]
        lengths = rollouts.completion_mask.sum(1)
        for kind, mask in (
            ("replayed", rollouts.replayed),
            ("fresh_correct", ~rollouts.replayed & rollouts.correct),
        ):
            self.tokens[kind][0] += int(lengths[mask].sum())
            self.tokens[kind][1] += int(mask.sum())
        fresh_ids = fresh_questions(rollouts, batch.get("experience"), outputs.get("gave_way"))
        self._fresh_trained += len(fresh_ids)
        self._fresh_distinct |= fresh_ids
        rows = rollouts.replayed.nonzero().flatten().tolist()
        if rows:
            families = [rollouts.domains[i] if rollouts.domains else "" for i in rows]
            self.replayed.append((_step(trainer, pl_module), rollouts.question_ids[rows].tolist(), families))
        replay = next((c for c in trainer.callbacks if isinstance(c, ReplayCallback)), None)
        if replay is not None and _step(trainer, pl_module) % self.every == 0:
            bucketer, k = replay.buffer.bucketer, pl_module.num_generations
            known = bucketer.known_questions()
            correct, total = bucketer.latest_counts(known)
            in_play = ~torch.isin(known, torch.tensor(sorted(bucketer.retired), dtype=torch.long))
            # Out of K: a question sampled twice in one step (fresh and replayed) has a larger latest group.
            bucket = (k * correct / total.clamp(min=1)).round().long()
            counts = torch.bincount(bucket[in_play], minlength=k + 1)
            self.buckets.append((_step(trainer, pl_module), counts.tolist()))
            out = len(trainer.datamodule.excluded_question_ids)
            self.retired.append((_step(trainer, pl_module), len(bucketer.retired), out))

    def summary(self) -> dict:
        counts = Counter(q for _, ids, _ in self.replayed for q in ids)
        per_question = sorted(counts.values(), reverse=True)
        top = per_question[: max(1, len(per_question) // 10)]
        return {
            "replays": sum(per_question),
            "distinct_questions": len(per_question),
            "max_replays_per_question": per_question[0] if per_question else 0,
            "top_tenth_share": sum(top) / sum(per_question) if per_question else 0.0,
            "replays_per_question": per_question,
            "completion_tokens": {kind: total / n if n else None for kind, (total, n) in self.tokens.items()},
            "replayed": self.replayed,
            "buckets": self.buckets,
            "retired": self.retired,
        }


def _step(trainer, pl_module) -> int:
    """Generated batches trained on: Lightning's `global_step` counts optimizer updates."""
    return trainer.global_step // pl_module.updates_per_batch


def train_for_batches(cli, overlay: dict, shipped_updates: int) -> None:
    """Sets the built trainer's `max_steps` (optimizer updates) to the run's batches times the variant's
    updates per batch, so every variant trains on as many batches: a task's or --quick's `max_steps` counts
    batches, a preset's own counts its updates (`shipped_updates` a batch, as the preset ships)."""
    batches = cli.trainer.max_steps
    if "max_steps" not in overlay.get("trainer", {}):
        batches //= shipped_updates
    cli.trainer.fit_loop.epoch_loop.max_steps = batches * cli.model.updates_per_batch


def fresh_questions(rollouts, experience=None, gave_way=None) -> set[int]:
    """The fresh questions a step consumed: those of its fresh groups (a group with a replayed row is not
    fresh: a displaced or refilled question is not, though the same question in a fresh group is), those a
    stored row joined (`placement="join"`: the batch's own questions, K-1 of their rollouts fresh), and
    those whose group of equal rewards gave its place to refill (sampled from the fresh stream as under
    GRPO, which trains on them with no gradient)."""
    k = rollouts.group_size
    if k > 1:  # by group: a replayed question may also be one of the batch's, in a fresh group of its own
        fresh_groups = ~rollouts.replayed.view(-1, k).any(1)  # [G]
        fresh = set(rollouts.question_ids.view(-1, k)[fresh_groups, 0].tolist())
    else:  # a swap step: stored rows only
        fresh = set(rollouts.question_ids[~rollouts.replayed].tolist())
    if experience is not None and experience.placement == "join":
        fresh |= set(experience.rollouts.question_ids.tolist())
    if gave_way is not None:
        fresh |= set(gave_way.question_ids.tolist())
    return fresh


def run(
    task: str,
    name: str,
    seed: int,
    steps: int | None,
    workdir: Path,
    threads: int,
    measure=None,
    adjust=None,
) -> dict:
    """One training run; returns its curve [(step, generated tokens, val pass@1)] and its diagnostics, and
    with `measure(cli, task)` what that returns about the final weights, under "final". `adjust(overlay,
    task)` may change the task's overlay (a config dict laid over the preset) before the run starts."""
    torch.set_num_threads(threads)
    preset, change, _ = VARIANTS[name]
    overlay = task_overlay(task)
    # Every preset's curve at the training temperature, our yardstick (the paper preset validates at 0.6);
    # benchmarks/learning_yardstick.py adds the paper's.
    overlay.setdefault("model", {})["val_temperature"] = 1.0
    if steps is not None:
        trainer = overlay.setdefault("trainer", {})
        trainer.update(max_steps=steps, val_check_interval=max(steps // 4, 1))
    if adjust is not None:
        adjust(overlay, task)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    args = [
        "--config", str(ROOT / "configs" / f"{preset}.yaml"), "--config", str(workdir / "overlay.yaml"),
        f"--seed_everything={seed}", "--trainer.max_epochs=1000", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={workdir}",
    ]  # fmt: skip
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    _check_seeds_follow_the_run(cli, preset)
    shipped_updates = cli.model.updates_per_batch
    if change is not None:
        change(cli)
    train_for_batches(cli, overlay, shipped_updates)
    replay = next((c for c in cli.trainer.callbacks if isinstance(c, ReplayCallback)), None)
    if replay is not None and preset == "exgrpo_swap" and task != "arithmetic":
        replay.replay_start_epoch = SWAP_START_EPOCH[task]
    record = Record()
    cli.trainer.callbacks.append(record)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # The start (validate_at_start) goes to the logger only, as the first val/pass@1 event.
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    start = events.Scalars("val/pass@1")[0].value
    curve = [(0, 0.0, start), *record.curve]
    fresh = [(0, 0), *record.fresh]
    result = {
        "seed": seed, "commit": code_version(), "machine": machine(), "curve": curve,
        "fresh_questions": fresh, "diagnostics": record.summary(),
    }  # fmt: skip
    if measure is not None:  # after the curve is read: the measurement may validate again
        result["final"] = measure(cli, task)
    return result


def code_version() -> str:
    """The commit a run's code came from, with "+changes" when the packages, the configs or this benchmark
    differ from it (runs resumed across commits each keep their own)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    changed = git(
        "diff", "--quiet", "HEAD", "--", "exgrpo_pl", "callbacks", "configs", "benchmarks/learning.py"
    )
    return head.stdout.strip() + ("+changes" if changed.returncode else "")


def machine() -> str:
    """The CPU, the kernels torch picks for it and the torch build: what else decides a run's numbers (a
    different CPU can take different kernels, whose rounding then moves the whole trajectory)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    return f"{cpu}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


def from_elsewhere(results: dict, here: str) -> list[str]:
    """Where the kept runs that did not run on `here` ran ("unrecorded" for runs from before machines were
    recorded), each once: runs of one seed on two machines share the seed, not the arithmetic."""
    machines = (
        record.get("machine", "unrecorded") for by_variant in results.values() for runs in by_variant.values()
        for record in runs
    )  # fmt: skip
    return sorted({m for m in machines if m != here})


def say_where_kept_runs_ran(results: dict, file_name: str) -> None:
    """Prints the machines of the kept runs of a resumed results file that ran elsewhere than this one."""
    elsewhere = from_elsewhere(results, machine())
    if elsewhere:
        print(f"note: kept runs of {file_name} ran on other machines than this one ({machine()}), or recorded"
              " none: " + "; ".join(elsewhere), flush=True)  # fmt: skip


def _check_seeds_follow_the_run(cli, config: str) -> None:
    """Refuses a config that pins the data order or the replay draws: every seed would share them."""
    pinned = []
    if cli.datamodule.hparams.seed is not None:
        pinned.append(f"data.seed={cli.datamodule.hparams.seed}")
    for callback in cli.trainer.callbacks:
        if isinstance(callback, ReplayCallback) and not callback.replay.follows_run_seed:
            pinned.append(f"the replay seed {callback.replay.seed}")
    if pinned:
        raise ValueError(
            f"configs/{config}.yaml pins {' and '.join(pinned)}: the seeds of this benchmark would share that"
            " stream. Leave it unset (None), so that it follows --seed_everything."
        )


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% Student-t interval (0 for a single value)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / len(values) ** 0.5


def at_tokens(curve: list, budget: float) -> float:
    """Val pass@1 of a curve at `budget` generated tokens (linear between validations)."""
    tokens = [point[1] for point in curve]
    return float(np.interp(budget, tokens, [point[2] for point in curve]))


def at_fresh_questions(run_record: dict, budget: float) -> float:
    """Val pass@1 of a run at `budget` fresh questions trained on (linear between validations)."""
    trained = [point[0] for point in run_record["fresh_questions"]]
    return float(np.interp(budget, trained, [point[2] for point in run_record["curve"]]))


def summarise(results: dict) -> dict:
    """Per task and variant: start, final (equal steps), best, how far the final fell below the run's own best
    (points), the value at equal generated tokens, the final's difference from GRPO's and, for a variant of
    a preset, from the preset's (`FULL_METHOD`), each over the seeds both ran (paired, in points), and what
    replay did."""
    out = {}
    for task, variants in results.items():
        budget = min(run["curve"][-1][1] for runs in variants.values() for run in runs)
        out[task] = {"token_budget": budget, "variants": {}}
        for name in sorted(variants, key=list(VARIANTS).index):  # the tables' and plots' order
            runs = variants[name]
            preset, change, _ = VARIANTS[name]
            full = getattr(change, "full_method", FULL_METHOD.get(preset)) if change is not None else None
            out[task]["variants"][name] = {
                "seeds": len(runs),
                "start": interval([r["curve"][0][2] for r in runs]),
                "final": interval([r["curve"][-1][2] for r in runs]),
                "best": interval([max(p[2] for p in r["curve"]) for r in runs]),
                "below_best_points": interval(
                    [100 * (max(p[2] for p in r["curve"]) - r["curve"][-1][2]) for r in runs]
                ),
                "equal_tokens": interval([at_tokens(r["curve"], budget) for r in runs]),
                "vs_grpo_points": _paired(runs, variants.get("GRPO")) if name != "GRPO" else None,
                "vs_full_points": _paired(runs, variants.get(full)) if full else None,
                "replays": interval([r["diagnostics"]["replays"] for r in runs]),
                "distinct_replayed": interval([r["diagnostics"]["distinct_questions"] for r in runs]),
                "max_replays": interval([r["diagnostics"]["max_replays_per_question"] for r in runs]),
                "replayed_tokens": mean_completion_tokens(runs, "replayed"),
                "fresh_correct_tokens": mean_completion_tokens(runs, "fresh_correct"),
            }
    return out


def mean_completion_tokens(runs: list[dict], kind: str) -> tuple[float, float] | None:
    """Mean completion length of a kind of trajectory over the seeds; None unless every run recorded it (runs
    made before this diagnostic existed did not)."""
    values = [r["diagnostics"].get("completion_tokens", {}).get(kind) for r in runs]
    return None if None in values else interval(values)


def _paired(runs: list[dict], reference: list[dict] | None) -> tuple[float, float] | None:
    """Final val pass@1 minus the reference variant's at the same seed, in points (None: no seed shared)."""
    finals = {run["seed"]: run["curve"][-1][2] for run in reference or []}
    differences = [100 * (r["curve"][-1][2] - finals[r["seed"]]) for r in runs if r["seed"] in finals]
    return interval(differences) if differences else None


def report(results: dict, suffix: str) -> None:
    """Print the tables and write the JSON and the plots for the runs finished so far."""
    summary = summarise(results)
    for task, entry in summary.items():
        budget = entry["token_budget"]
        print(f"\n{task}: val pass@1, mean ± 95% interval over seeds; equal tokens = {budget:.0f}\n")
        print(markdown_table(entry["variants"]))
        for name, row in entry["variants"].items():
            if row["replayed_tokens"] is not None and row["fresh_correct_tokens"] is not None:
                print(
                    f"{name}: completions of {_fmt(row['replayed_tokens'], '.2f')} tokens replayed, fresh"
                    f" correct ones {_fmt(row['fresh_correct_tokens'], '.2f')}"
                )
    print("\nthe presets, final val pass@1:\n")
    print(presets_table(summary))
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"summary": summary, "runs": _without_replay_records(results)}
    # Without the spaces after separators: the per-step replay records make this the largest results file.
    (RESULTS / f"learning{suffix}.json").write_text(json.dumps(record, separators=(",", ":")))
    for task in results:
        _plot_curves(results[task], summary[task], RESULTS / f"learning_{task}{suffix}.png", task)
        _plot_diagnostics(results[task], RESULTS / f"learning_{task}_replay{suffix}.png", task)
    print(f"wrote {RESULTS}/learning{suffix}.json and its plots")


def markdown_table(rows: dict) -> str:
    """The summary of one task as docs/learning.md shows it: "vs GRPO" and "vs full method" pair runs of the
    same seed; the paper's column is its ablation table's average accuracy, and that minus its GRPO's and
    its full method's."""
    columns = (
        "variant", "seeds", "final val pass@1 (equal steps)", "vs GRPO, same seeds (points)",
        "vs full method, same seeds (points)", "final below own best (points)", "at equal tokens",
        "paper: average, vs GRPO, vs full",
        "replayed trajectories (distinct questions)", "most replays of one question",
    )  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name, row in rows.items():
        paper = VARIANTS[name][2]
        if paper is not None and name != "GRPO":
            versus_full = f", {paper - PAPER_FULL:+.1f}" if VARIANTS[name][1] is not None else ""
            paper = f"{paper}, {paper - PAPER_GRPO:+.1f}{versus_full}"
        vs_grpo, vs_full = (
            "—" if row[key] is None else _fmt(row[key], "+.1f")
            for key in ("vs_grpo_points", "vs_full_points")
        )
        replay = row["replays"][0] > 0
        replayed = f"{row['replays'][0]:,.0f} ({row['distinct_replayed'][0]:,.0f})" if replay else "—"
        most = f"{row['max_replays'][0]:.0f}" if replay else "—"
        cells = (
            name, row["seeds"], _fmt(row["final"]), vs_grpo, vs_full, _fmt(row["below_best_points"], ".1f"),
            _fmt(row["equal_tokens"]),
            "—" if paper is None else paper, replayed, most,
        )  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def presets_table(summary: dict) -> str:
    """The shipped presets side by side, a row per task: each one's final val pass@1, and the recommended
    preset paired with GRPO and measured against its own best (docs/learning.md's first table)."""
    columns = (
        "task", *PRESETS, "recommended vs GRPO, same seeds (points)",
        "recommended: final below own best (points)",
    )  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for task in (task for task in TASKS if task in summary):
        rows = summary[task]["variants"]
        if not all(name in rows for name in PRESETS):
            continue
        most = max(rows[name]["seeds"] for name in PRESETS)
        finals = [
            _fmt(row["final"]) + ("" if row["seeds"] == most else f" ({row['seeds']} of {most} seeds)")
            for row in (rows[name] for name in PRESETS)
        ]
        recommended = rows["ExGRPO recommended"]
        cells = (
            task, *finals, _fmt(recommended["vs_grpo_points"], "+.1f"),
            _fmt(recommended["below_best_points"], ".1f"),
        )  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _without_replay_records(results: dict) -> dict:
    """The runs to save: the step-by-step record of what was replayed (most of the file's size) is kept
    only for the runs the diagnostics plot draws, the lowest seed of each of its presets; every run keeps its
    summary."""
    saved: dict = {}
    for task, variants in results.items():
        saved[task] = {}
        for name, runs in variants.items():
            first = _lowest_seed(runs) if name in DIAGNOSED else None
            saved[task][name] = [
                run if run is first or "replayed" not in run["diagnostics"]
                else {**run, "diagnostics": {k: v for k, v in run["diagnostics"].items() if k != "replayed"}}
                for run in runs
            ]  # fmt: skip
    return saved


def _lowest_seed(runs: list[dict]) -> dict:
    return min(runs, key=lambda run: run["seed"])


def _fmt(value: tuple[float, float], spec: str = ".3f") -> str:
    """Mean ± the half-width of its interval (0 for one seed)."""
    mean, half = value
    return f"{mean:{spec}} ± {half:{spec.lstrip('+')}}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_curves(runs_by_variant: dict, summary: dict, path: Path, task: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for name in summary["variants"]:
        runs = runs_by_variant[name]
        points = min(len(r["curve"]) for r in runs)
        curves = np.array([[p for p in r["curve"][:points]] for r in runs])  # [seeds, points, 3]
        style = "-" if name in PRESETS else ":"  # presets solid with their intervals, ablations dotted
        for ax, column in zip(axes, (0, 1)):
            xs = curves[:, :, column].mean(0) / (1 if column == 0 else 1000)
            mean = curves[:, :, 2].mean(0)
            (line,) = ax.plot(xs, mean, marker="o", markersize=3, linestyle=style, label=name)
            if name in PRESETS and len(runs) > 1:
                half = [interval(list(curves[:, i, 2]))[1] for i in range(points)]
                ax.fill_between(xs, mean - half, mean + half, color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel(BATCHES_AXIS)
    axes[1].set_xlabel("generated tokens (thousands)")
    axes[1].axvline(summary["token_budget"] / 1000, color="grey", linewidth=0.8, linestyle="--")
    axes[0].set_ylabel("val pass@1 (mean over seeds; band: 95% interval)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{task} task: GRPO vs ExGRPO and the paper's ablations")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_diagnostics(runs_by_variant: dict, path: Path, task: str) -> None:
    """For the replaying presets (first seed): buckets over time, families replayed, replays per question."""
    plt = _pyplot()
    shown = [n for n in DIAGNOSED if n in runs_by_variant]
    if not shown:
        return
    # 11 inches at 100 dpi: shown about 900 px wide in the docs' column, the 8-10 pt text stays about 9-11 px.
    fig, axes = plt.subplots(len(shown), 3, figsize=(11, 3.6 * len(shown)), squeeze=False)
    for row, name in zip(axes, shown):
        diagnostics = _lowest_seed(runs_by_variant[name])["diagnostics"]
        if diagnostics["buckets"]:
            steps = [s for s, _ in diagnostics["buckets"]]
            counts = np.array([c for _, c in diagnostics["buckets"]]).T  # [K+1, points]
            row[0].stackplot(steps, counts, labels=[f"{k} correct" for k in range(len(counts))])
            row[0].legend(fontsize=8, ncol=3, loc="upper left")
        if diagnostics.get("retired"):  # runs made before this diagnostic have none
            steps, retired, out = zip(*diagnostics["retired"])
            row[0].plot(steps, retired, color="black", label="retired")
            row[0].plot(steps, out, color="black", linestyle="--", label="out of the fresh stream")
            row[0].legend(fontsize=8, ncol=3, loc="upper left")
        row[0].set_title(f"{name}:\nquestions in play per bucket, and retired", fontsize=10)
        row[0].set_xlabel("step")
        families = sorted({f for _, _, fam in diagnostics["replayed"] for f in fam})
        windows: dict[int, Counter] = {}
        for step, _, fam in diagnostics["replayed"]:
            windows.setdefault(step // 40 * 40, Counter()).update(fam)
        if windows and families:
            starts = sorted(windows)
            share = np.array([[windows[s][f] / sum(windows[s].values()) for s in starts] for f in families])
            row[1].stackplot(starts, share, labels=families)
            row[1].legend(fontsize=8, ncol=2, loc="upper left")
        row[1].set_title(f"{name}:\nfamilies of replayed questions (per 40 steps)", fontsize=10)
        row[1].set_xlabel("step")
        per_question = diagnostics["replays_per_question"]
        if per_question:
            row[2].hist(per_question, bins=range(1, max(per_question) + 2), log=True)
        row[2].set_title(
            f"{name}:\nreplays per question ({diagnostics['distinct_questions']} distinct)", fontsize=10
        )
    seed = _lowest_seed(runs_by_variant[shown[0]])["seed"]
    fig.suptitle(f"{task} task: what replay did (seed {seed})", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the three presets, 2 seeds, short runs")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: all (--quick: presets)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 2 quick, 5 full)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the task's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each with 2 / jobs threads")
    parser.add_argument("--resume", action="store_true", help="keep finished runs of the results file")
    parser.add_argument("--report", action="store_true", help="tables and plots of the results file; no runs")
    args = parser.parse_args()
    if args.report:
        saved = json.loads((RESULTS / f"learning{'_quick' if args.quick else ''}.json").read_text())["runs"]
        report(saved, "_quick" if args.quick else "")
        return
    names = args.variants or (PRESETS if args.quick else tuple(VARIANTS))
    seeds = range(args.seeds or (2 if args.quick else 5))
    suffix = "_quick" if args.quick else ""
    threads = max(1, 2 // args.jobs)
    results: dict = {task: {} for task in args.tasks}
    path = RESULTS / f"learning{suffix}.json"
    # Other tasks and variants of an earlier run stay; with --resume its runs of these too. (A file of the
    # older layout, without "runs", is replaced.)
    previous = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
    for task, variants in previous.items():
        for name, runs in variants.items():
            if task not in args.tasks or name not in names or args.resume:
                results.setdefault(task, {})[name] = runs
    say_where_kept_runs_ran(results, path.name)
    # Seed by seed, every variant of a seed before the next: a run stopped early leaves the variants with
    # the same seeds, comparable as they stand.
    todo = [
        (task, name, seed)
        for task in args.tasks
        for seed in seeds
        for name in names
        if seed not in {r["seed"] for r in results[task].get(name, [])}
    ]
    # The tiny models' matmuls barely use a second thread, so two one-thread runs side by side finish
    # sooner than two two-thread runs one after the other. Results do not depend on it (seeded runs).
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        jobs = {}
        for task, name, seed in todo:
            steps = args.steps or (QUICK_STEPS[task] if args.quick else None)
            workdir = Path(tmp) / f"{task}-{name.replace(' ', '_')}-{seed}"
            jobs[pool.submit(run, task, name, seed, steps, workdir, threads)] = (task, name)
        try:
            for done in as_completed(jobs):
                task, name = jobs[done]
                results[task].setdefault(name, []).append(done.result())
                # Written after every run, so a long run that is stopped still leaves what it measured.
                report({t: {n: r for n, r in v.items() if r} for t, v in results.items() if v}, suffix)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # fail now, not after every queued run
            raise
    if not todo:  # everything asked for is in the file already: print its tables again
        report({t: v for t, v in results.items() if v}, suffix)


if __name__ == "__main__":
    main()

"""SelectiveReplay: when to replay (the reference description's coin flip) and which experience (a buffer
sampling strategy).

The reference description's `replay_manager`: it owns the replay probability and the sampling settings, and
draws both from its own seeded generators, so every rank that builds it with the same seed and makes the same
calls takes the same replay decisions (a rank that generates while another replays deadlocks under ZeRO-3).
Plain PyTorch, no Lightning.
"""

from __future__ import annotations

import torch

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience.buffer import (
    OFFICIAL_PICK,
    REPLAYED_TRAJECTORIES,
    EntropyFn,
    TrajectoryBuffer,
    resolve_strategy,
)
from exgrpo_pl.experience.difficulty import check_rate_range
from exgrpo_pl.seeding import derive_seed, split_seed
from exgrpo_pl.validation import check_number

# The trajectory selections for which `TrajectoryBuffer.sample` calls `entropy_fn` (the others rank by the
# entropy stored at collection, or not at all).
RESCORING_SELECTIONS = ("lowest_entropy", "highest_entropy", OFFICIAL_PICK)


class SelectiveReplay:
    """Replay schedule and sampling strategy.

    Decisions and samples come from two generators seeded from `seed`: the decision stream must stay in
    lockstep across ranks, while how much randomness a sample consumes depends on each rank's own buffer.
    With `seed=None` the seed is derived from the run seed (`derive_seed("replay")`, the same on every rank
    that `seed_everything` seeded), at construction and again by `follow_run_seed()`, which
    `ReplayCallback` calls when training is set up, so a `seed_everything` after construction counts.

    Args:
        strategy: "entropy_guided" (the reference description's name, = "medium_difficulty_low_entropy") or
            any name in `exgrpo_pl.experience.buffer.STRATEGIES`, e.g. "gaussian_lowest_entropy" (the paper).
        replay_probability: chance in [0, 1] that `should_replay()` says yes.
        medium_difficulty_range: (low, high) correctness-rate range of "medium_range" question sampling.
        entropy_percentile: percentile of "low_entropy_percentile" trajectory selection.
        gaussian_sigma: width of "gaussian" question sampling, in rate units.
        question_sampling: overrides the strategy's question sampling (ablations).
        trajectory_selection: overrides the strategy's trajectory selection (ablations;
            "official_inverted_mask_entropy" ranks by the official code's score, to compare with the paper's).
        adaptive_range: centre the medium range on the median rate of the questions in play, see
            `DifficultyBucketer.medium_range`.
        seed: seed of the decision and sampling generators, the same on every rank; None: derived from the
            run seed.
        replayed_trajectories: "correct" (ExGRPO: only correct stored trajectories are replayed, whatever
            the buffer's `keep` stores) or "any_stored_including_incorrect" (the reference description's
            buffer with `keep="all"`, whose selection ranks wrong answers with the right ones).
    """

    def __init__(
        self,
        strategy: str = "entropy_guided",
        replay_probability: float = 0.3,
        medium_difficulty_range: tuple[float, float] = (0.3, 0.7),
        entropy_percentile: float = 25,
        gaussian_sigma: float = 0.125,
        question_sampling: str | None = None,
        trajectory_selection: str | None = None,
        adaptive_range: bool = False,
        seed: int | None = None,
        replayed_trajectories: str = "correct",
    ) -> None:
        self.question_sampling, self.trajectory_selection = resolve_strategy(
            strategy, question_sampling, trajectory_selection
        )
        check_number("SelectiveReplay", "replay_probability", replay_probability, 0, 1)
        check_number("SelectiveReplay", "entropy_percentile", entropy_percentile, 0, 100)
        check_number("SelectiveReplay", "gaussian_sigma", gaussian_sigma, 0, low_open=True)
        check_number("SelectiveReplay", "seed", seed, integer=True, optional=True)
        if replayed_trajectories not in REPLAYED_TRAJECTORIES:
            raise ValueError(
                f"SelectiveReplay replayed_trajectories={replayed_trajectories!r}; allowed: "
                f"{', '.join(REPLAYED_TRAJECTORIES)}"
            )
        self.replayed_trajectories = replayed_trajectories
        self.strategy = strategy
        self.replay_probability = float(replay_probability)
        self.medium_difficulty_range = check_rate_range(medium_difficulty_range, "medium_difficulty_range")
        self.entropy_percentile = entropy_percentile
        self.gaussian_sigma = float(gaussian_sigma)
        self.adaptive_range = bool(adaptive_range)
        self.follows_run_seed = seed is None
        self._seed(derive_seed("replay") if seed is None else int(seed))

    def _seed(self, seed: int) -> None:
        self.seed = seed
        self._drawn = False
        self._decisions = torch.Generator().manual_seed(split_seed(seed, 0))
        # A different stream, so that sampling never shifts the decision stream.
        self._samples = torch.Generator().manual_seed(split_seed(seed, 1))

    def follow_run_seed(self) -> None:
        """Reseeds from the current run seed when built with `seed=None` and nothing was drawn yet."""
        if self.follows_run_seed and not self._drawn:
            self._seed(derive_seed("replay"))

    def should_replay(self) -> bool:
        """One coin flip with probability `replay_probability`, from the decision generator."""
        self._drawn = True
        return bool(torch.rand((), generator=self._decisions) < self.replay_probability)

    @property
    def rescores(self) -> bool:
        """Whether `sample` may call `entropy_fn`, i.e. run the policy on stored trajectories (it does when a
        sampled question has more than one)."""
        return self.trajectory_selection in RESCORING_SELECTIONS

    def medium_range(self, buffer: TrajectoryBuffer) -> tuple[float, float]:
        """The medium-difficulty range in effect for `buffer` (adaptive or not)."""
        return buffer.bucketer.medium_range(self.medium_difficulty_range, self.adaptive_range)

    def sample(
        self,
        buffer: TrajectoryBuffer,
        size: int,
        entropy_fn: EntropyFn | None = None,
        questions: torch.Tensor | None = None,
    ) -> RolloutBatch:
        """Up to `size` trajectories from `buffer` with this strategy, among `questions` where given (one per
        question), see `TrajectoryBuffer.sample`."""
        self._drawn = True
        return buffer.sample(
            self.strategy,
            size=size,
            difficulty_range=self.medium_range(buffer),
            entropy_percentile=self.entropy_percentile,
            generator=self._samples,
            entropy_fn=entropy_fn,
            gaussian_sigma=self.gaussian_sigma,
            question_sampling=self.question_sampling,
            trajectory_selection=self.trajectory_selection,
            replayed_trajectories=self.replayed_trajectories,
            questions=questions,
        )

    def state_dict(self) -> dict:
        """Generator states as uint8 tensors; loadable with `torch.load(weights_only=True)`."""
        return {
            "decision_generator": self._decisions.get_state(),
            "sample_generator": self._samples.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._drawn = True  # a restored stream goes on; the run seed no longer picks it
        self._decisions.set_state(state["decision_generator"])
        self._samples.set_state(state["sample_generator"])

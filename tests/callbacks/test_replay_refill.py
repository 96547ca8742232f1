"""ReplayCallback(placement="refill") in real Trainer runs on a tiny model: after the fresh groups are scored,
the groups whose K rewards are all equal give their places to replayed questions (the stored row and K-1
rollouts of a second round), no more than mix_fraction allows; every other fresh question stays; the count is
logged; the groups that gave way still count as evidence of difficulty; a resumed run is the uninterrupted
one bitwise; a module whose step cannot refill is stopped at setup."""

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback
from test_replay_join import BATCH, fit_placement
from test_resume import Run, assert_same, final_state, logged

from exgrpo_pl.contract import ContractError
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.step.refill import idle_groups

ROWS, K = 16, 4  # 4 steps an epoch of BATCH (4) questions
# These tests are about where the stored rows go, not which are drawn: every stored row may be replayed.
ANY_STORED = {"replayed_trajectories": "any_stored_including_incorrect"}


class RecordSteps(Callback):
    """Per step: the batch's question ids, each trained group's question ids, the replayed rows' indices,
    the question ids and rewards of the groups that gave way, and the generated tokens so far."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts, gave_way = outputs["rollouts"], outputs["gave_way"]
        groups = rollouts.question_ids.view(-1, K).tolist()
        replayed = rollouts.replayed.nonzero().flatten().tolist()
        gave = [] if gave_way is None else gave_way.question_ids.view(-1, K)[:, 0].tolist()
        gave_rewards = [] if gave_way is None else gave_way.rewards.view(-1, K).tolist()
        self.steps.append((batch["question_id"].tolist(), groups, replayed, gave, gave_rewards))


def train(root, model_dir, steps, ckpt_path=None, module=None, **options) -> Run:
    """Refilling from the second step on; a checkpoint at the end."""
    return fit_placement(root, model_dir, steps, "refill", ROWS, RecordSteps(), ckpt_path, module, **options)


def test_groups_with_equal_rewards_give_their_places_to_replayed_questions(tmp_path, tiny_model_dir):
    run = train(tmp_path, tiny_model_dir, 6, mix_fraction=0.5)
    refilled = []
    for batch, groups, replayed, gave, gave_rewards in run.steps:
        assert len(groups) == BATCH and all(len(set(group)) == 1 for group in groups)
        fresh = [group[0] for g, group in enumerate(groups) if g * K not in replayed]
        # Every fresh question of the batch: trained on, or gave its place as a group of equal rewards.
        assert sorted(fresh + gave) == sorted(batch) and len(gave) == len(replayed)
        assert all(len(set(rewards)) == 1 for rewards in gave_rewards)
        for row in replayed:  # the stored row opens its question's group, after the kept fresh groups
            assert row % K == 0 and row // K >= len(fresh)
        refilled.append(len(replayed))
    assert refilled[0] == 0 and any(refilled) and max(refilled) <= BATCH // 2  # mix_fraction 0.5 caps at 2
    assert [float(logged(run, "replay/refilled_groups")[s]) for s in range(6)] == refilled


def test_the_groups_that_gave_way_are_evidence_but_are_not_stored(tmp_path, tiny_model_dir):
    run = train(tmp_path, tiny_model_dir, 6, mix_fraction=1.0)
    bucketer = run.replay.buffer.bucketer
    last = next(step for step in reversed(run.steps) if step[3])
    gave = torch.tensor(last[3])
    correct, total = bucketer.latest_counts(gave)
    assert total.tolist() == [K] * len(gave)  # their latest group is the one that gave way
    assert correct.tolist() == [int(sum(rewards)) if rewards[0] > 0.5 else 0 for rewards in last[4]]
    # Stored rows all come from trained groups: they carry the training forward's behaviour log-probs.
    stored = run.replay.buffer.policy_snapshot["behaviour_logps"]
    assert stored and all(bool(logps.ne(0).any()) for logps in stored)


def test_idle_groups_are_those_whose_rewards_are_all_equal():
    rewards = torch.tensor([1.0, 1, 1, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])
    assert idle_groups(rewards, 4).tolist() == [False, True, True]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    return train(tmp_path_factory.mktemp("straight"), tiny_model_dir, 6)


def test_a_resumed_run_is_the_uninterrupted_run_bitwise(tmp_path, tiny_model_dir, straight, recwarn):
    train(tmp_path / "split", tiny_model_dir, 3)
    resumed = train(tmp_path / "split", tiny_model_dir, 6, ckpt_path="last")
    assert resumed.steps == straight.steps[3:] and any(replayed for _, _, replayed, _, _ in resumed.steps)
    assert_same(final_state(straight), final_state(resumed))
    assert resumed.module.generated_tokens == straight.module.generated_tokens
    assert not [w for w in recwarn if "Resuming" in str(w.message)]


class CannotRefill(ExGRPOModule):
    """A module whose step places experience as the contract's mix only."""

    replay_placements = ("displace", "join")


def test_a_module_whose_step_cannot_refill_is_stopped_before_the_first_step(tmp_path, tiny_model_dir):
    module = tiny_module(tiny_model_dir)
    module.__class__ = CannotRefill
    with pytest.raises(ContractError, match=r"placement='refill': CannotRefill.training_step must .*"
                       r"replay_placements = \('displace', 'join', 'refill'\)"):  # fmt: skip
        train(tmp_path, tiny_model_dir, 2, module=module)

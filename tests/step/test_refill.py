"""The pieces that fill dead groups (exgrpo_pl.step.refill), on small exact cases: which groups may give
way, DAPO's filter, where the new groups go, and that fresh and replayed sources are placed alike."""

import torch
from test_batch import rollout_batch

from exgrpo_pl.step.losses import group_advantages
from exgrpo_pl.step.refill import advantages_of, dead_places, idle_groups, informative, placed

K = 2


def groups(question_ids, rewards, replayed=None):
    """Groups of K rows: one question id per group, one reward per row."""
    ids = torch.tensor(question_ids).repeat_interleave(K)
    n = len(ids)
    flags = torch.zeros(n, dtype=torch.bool) if replayed is None else torch.tensor(replayed)
    return rollout_batch(
        n, question_ids=ids, rewards=torch.tensor(rewards, dtype=torch.float32), replayed=flags,
        advantages=torch.ones(n),
    ).select(torch.arange(n), group_size=K)  # fmt: skip


def test_idle_groups_are_those_whose_rewards_are_all_equal():
    assert idle_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), K).tolist() == [True, False, True]


def test_a_group_with_a_replayed_row_never_gives_way():
    batch = groups([5, 6, 7], [1, 1, 0, 0, 1, 0], replayed=[True, False, False, False, False, False])
    assert dead_places(batch).tolist() == [False, True, False]


def test_informative_keeps_the_first_n_groups_whose_rewards_differ_and_returns_the_rest():
    sampled = groups([1, 2, 3, 4], [0, 0, 1, 0, 1, 1, 0, 1])
    chosen, rest = informative(sampled, 1)
    assert chosen.question_ids.tolist() == [2, 2] and rest.question_ids.tolist() == [1, 1, 3, 3, 4, 4]
    chosen, rest = informative(sampled, 5)
    assert chosen.question_ids.tolist() == [2, 2, 4, 4] and chosen.group_size == K


def test_the_first_places_give_way_to_the_new_groups_which_follow_those_that_stay():
    batch = groups([1, 2, 3, 4], [0, 0, 1, 0, 1, 1, 0, 1])
    places = dead_places(batch)  # [True, False, True, False]
    trained, gave_way = placed(batch, places, groups([9], [1, 0]))
    assert trained.question_ids.tolist() == [2, 2, 3, 3, 4, 4, 9, 9]
    assert gave_way.question_ids.tolist() == [1, 1] and gave_way.advantages.tolist() == [0.0, 0.0]
    assert len(trained) == len(batch)


def test_fresh_and_replayed_groups_take_the_same_places():
    batch = groups([1, 2, 3], [0, 0, 1, 0, 1, 1])
    places = dead_places(batch)
    fresh = groups([8, 9], [0, 1, 1, 1])
    replayed = groups([8, 9], [1, 0, 1, 1], replayed=[True, False, True, False])
    a, gave_a = placed(batch, places, fresh)
    b, gave_b = placed(batch, places, replayed)
    assert a.question_ids.tolist() == b.question_ids.tolist() == [2, 2, 8, 8, 9, 9]
    assert gave_a.question_ids.tolist() == gave_b.question_ids.tolist() == [1, 1, 3, 3]
    assert a.replayed.tolist() == [False] * 6 and b.replayed.tolist() == [
        False,
        False,
        True,
        False,
        True,
        False,
    ]


def test_advantages_of_uses_the_modules_own_definition_when_given():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # two groups of 4

    def own(grouped):  # [G, K] -> [G, K]: mean-centred, no std division (another eps than the library's)
        return grouped - grouped.mean(1, keepdim=True)

    expected = [-0.75, 0.25, 0.25, 0.25, -0.25, -0.25, -0.25, 0.75]
    assert advantages_of(rewards, 4, "group", advantages=own).tolist() == expected
    assert torch.equal(advantages_of(rewards, 4, "group"), group_advantages(rewards, 4, "group"))

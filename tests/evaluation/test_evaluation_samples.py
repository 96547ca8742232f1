"""An evaluation batch's rollouts become one ProblemSamples per problem, with the rows cut at the limit."""

import torch

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.evaluation.samples import clipped_rows, problem_samples

EOS = 2


def rollouts(completions: list[list[int]], correct: list[bool], texts: list[str]) -> RolloutBatch:
    """Rows with these completion ids (right-padded with 0), correctness and texts."""
    width = max(map(len, completions))
    ids = torch.tensor([c + [0] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions], dtype=torch.bool)
    n = len(completions)
    zeros = torch.zeros(n)
    return RolloutBatch(
        question_ids=torch.arange(n), prompt_ids=torch.ones(n, 1, dtype=torch.long),
        prompt_mask=torch.ones(n, 1, dtype=torch.bool), completion_ids=ids, completion_mask=mask,
        behaviour_logps=torch.zeros(ids.shape), rewards=torch.tensor(correct, dtype=torch.float),
        correct=torch.tensor(correct), entropy=zeros, advantages=zeros,
        policy_version=torch.zeros(n, dtype=torch.long), replayed=torch.zeros(n, dtype=torch.bool),
        completions=texts,
    )  # fmt: skip


def test_rows_are_grouped_by_problem_with_lengths_cuts_and_answers():
    batch = rollouts(
        [[5, 6, EOS], [5, 6, 7], [5], [7, 7, 7], [4, EOS]],
        [True, False, True, False, False],
        ["a=1", "a=2", "a=1", "b", "c=3"],
    )
    clipped = clipped_rows(batch, max_new_tokens=3, stop_ids=[EOS])
    assert clipped.tolist() == [False, True, False, True, False]  # full length and no stop token
    answer_of = lambda text, row: text.split("=")[1] + row["unit"] if "=" in text else None  # noqa: E731
    first, second = problem_samples(
        batch, [3, 2], clipped, [11, 12], answer_of, domains=["x", "y"], columns={"unit": ["", "!"]}
    )
    assert first.correct == [True, False, True] and first.lengths == [3, 3, 1]
    assert (
        first.truncated == [False, True, False] and first.answers == ["1", "2", "1"] and first.domain == "x"
    )
    assert (first.question_id, second.question_id) == (11, 12)
    assert second.correct == [False, False] and second.answers == [None, "3!"] and second.domain == "y"
    (alone,) = problem_samples(batch, [5], clipped)
    assert alone.answers is None and alone.domain is None and len(alone.correct) == 5

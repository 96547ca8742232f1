"""exgrpo_pl.mixin.ReplayMixin on ExGRPOModule: rescoring micro-batches, and the ZeRO-3 forward-count contract
(`entropy_forwards` is exactly what `score_entropy` runs)."""

import pytest
import torch
from conftest import tiny_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import RolloutBatch, pad_sequences
from exgrpo_pl.rollout import score_entropy


def stored_rows(n: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """n trajectories of varied prompt and completion lengths, padded as the buffer stores them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 5, (2, n), generator=g)
    prompts = [torch.randint(3, vocab, (int(k),), generator=g) for k in lengths[0]]
    completions = [torch.randint(3, vocab, (int(k),), generator=g) for k in lengths[1]]
    prompt_ids, prompt_mask = pad_sequences(prompts, left=True)
    completion_ids, completion_mask = pad_sequences(completions, left=False)
    zeros = torch.zeros(n)
    return RolloutBatch(
        question_ids=torch.arange(n),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logps=torch.zeros(completion_ids.shape),
        rewards=zeros,
        correct=zeros.bool(),
        entropy=zeros,
        advantages=zeros,
        policy_version=torch.zeros(n, dtype=torch.long),
        replayed=torch.ones(n, dtype=torch.bool),
    )


class ForwardCounter:
    """Counts the policy's forward calls (each one is a parameter gather under ZeRO-3)."""

    def __init__(self, policy):
        self.calls = 0
        policy.register_forward_pre_hook(self.count)

    def count(self, module, args):
        self.calls += 1


@pytest.fixture(scope="module")
def modules(tiny_model_dir):
    """One module per training micro-batch setting (None: the whole batch per forward), K = 4."""
    built = {}
    for micro_batch_size in (None, 1, 3, 8):
        module = tiny_module(tiny_model_dir, micro_batch_size=micro_batch_size)
        module.configure_model()
        built[micro_batch_size] = (module, ForwardCounter(module.policy))
    return built


def test_rescoring_rows_are_the_training_micro_batch_else_k(modules):
    assert [modules[m][0].rescore_rows() for m in (None, 1, 3, 8)] == [4, 1, 3, 8]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    micro_batch_size=st.sampled_from([None, 1, 3, 8]),
    rows=st.integers(0, 10),
    extra=st.integers(0, 3),
)
def test_entropy_forwards_is_exactly_what_score_entropy_runs(modules, micro_batch_size, rows, extra):
    module, counter = modules[micro_batch_size]
    candidates = stored_rows(rows, module.policy.config.vocab_size, seed=rows)
    forwards = module.entropy_forwards(candidates)
    before = counter.calls
    with torch.no_grad():
        scores = module.score_entropy(candidates)
    assert counter.calls - before == forwards
    assert scores.shape == (rows,)
    # A rank told to run more (another rank has more to rescore) runs exactly that many.
    before = counter.calls
    with torch.no_grad():
        padded = module.score_entropy(candidates, num_forwards=forwards + extra)
    assert counter.calls - before == forwards + extra
    assert torch.equal(padded, scores)


def test_module_scores_are_the_functions_whatever_the_chunk(modules):
    module, _ = modules[3]
    candidates = stored_rows(7, module.policy.config.vocab_size)
    expected = score_entropy(module.policy, candidates, module.hparams.temperature, 3)
    assert torch.equal(module.score_entropy(candidates), expected)
    module.hparams.logit_chunk_elements = 1  # a module may expose the chunk budget as a hyperparameter
    try:
        assert torch.equal(module.score_entropy(candidates), expected)
    finally:
        del module.hparams.logit_chunk_elements

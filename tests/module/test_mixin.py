"""exgrpo_pl.module.ReplayMixin on ExGRPOModule: rescoring micro-batches, and the ZeRO-3 forward-count
contract (`entropy_forwards` is exactly what `score_entropy` runs)."""

import pytest
import torch
from conftest import tiny_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import RolloutBatch, pad_sequences
from exgrpo_pl.step.rollout import score_entropy


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


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
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


def test_micro_batched_replay_steps_record_and_weight_each_slice_as_the_whole(modules):
    """`rows=`: a step of your own that runs its forwards in micro-batches gets the whole-batch result."""
    module, _ = modules[None]
    g = torch.Generator().manual_seed(0)
    whole = stored_rows(5, 16)
    whole.replayed = torch.tensor([False, True, False, True, False])
    whole.advantages, whole.entropy = torch.randn(5, generator=g), torch.zeros(5)
    whole.behaviour_logps = -torch.rand(whole.completion_ids.shape, generator=g)
    parts = RolloutBatch.cat([whole], group_size=1)  # a copy
    logps = (-torch.rand(whole.completion_ids.shape, generator=g)).requires_grad_()  # a forward's, with grad
    entropies, per_token = torch.rand(logps.shape, generator=g), torch.randn(logps.shape, generator=g)
    module.record_behaviour(whole, logps, entropies)
    expected = module.replay_loss(per_token, logps, whole)
    pieces = []
    for part in (slice(0, 2), slice(2, 5)):
        module.record_behaviour(parts, logps[part], entropies[part], rows=part)
        pieces.append(module.replay_loss(per_token[part], logps[part], parts, rows=part))
    assert torch.equal(parts.behaviour_logps, whole.behaviour_logps)
    assert torch.equal(parts.entropy, whole.entropy)
    assert torch.equal(torch.cat(pieces), expected)

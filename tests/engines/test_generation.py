"""exgrpo_pl.engines.generation: completion masks, positions of padded rows, and sampling that ignores the
checkpoint's generation config."""

import torch

from exgrpo_pl.engines.generation import completion_mask_from_ids, position_ids_from_mask, sample_completions
from exgrpo_pl.models import load_policy


def test_completion_mask_stops_after_the_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]])
    mask, truncated = completion_mask_from_ids(ids, eos_token_ids=[2])
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert truncated.tolist() == [False, True]


def test_positions_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_the_checkpoints_sampling_defaults_do_not_reach_the_rollouts(tiny_model_dir):
    """A chat checkpoint's generation config (repetition penalty, n-gram ban) changes what `generate` writes;
    rollouts ignore it and are drawn from softmax(logits / temperature) with top-p, as the loss assumes."""
    model = load_policy(tiny_model_dir)
    mask = torch.arange(6) >= torch.tensor([[0], [2], [3]])
    ids = torch.randint(3, 16, (3, 6), generator=torch.Generator().manual_seed(1)).masked_fill(~mask, 0)
    options = dict(max_new_tokens=12, temperature=0.0, top_p=1.0, pad_token_id=0, eos_token_ids=[2])
    plain, _, _ = sample_completions(model, ids, mask, **options)
    model.generation_config.repetition_penalty = 100.0
    model.generation_config.no_repeat_ngram_size = 1
    skewed = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=12)
    assert not torch.equal(skewed[:, ids.shape[1] :], plain)  # the config does change generate's output
    assert torch.equal(sample_completions(model, ids, mask, **options)[0], plain)
    assert model.generation_config.repetition_penalty == 100.0  # the model's own config is back

"""The static engine against the hf engine: same greedy tokens, log-probs the training forward agrees with,
reused buckets, weights updated between calls, LoRA; the compiled step in slow tests."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.data import ArithmeticTask
from exgrpo_pl.engines import ENGINES, HFEngine, SamplingConfig, StaticCacheEngine, build_engine
from exgrpo_pl.engines.generation import completion_mask_from_ids
from exgrpo_pl.engines.static import _nucleus, _pick
from exgrpo_pl.engines.static_cache import Bucket, bucket_size, kv_numel, meta_cache, place
from exgrpo_pl.models import load_policy, load_tokenizer
from exgrpo_pl.step.rollout import completion_logps

EOS, PAD = 2, 0


def sampling(budget: int, temperature: float = 0.0, top_p: float = 1.0) -> SamplingConfig:
    return SamplingConfig(budget, temperature, top_p, PAD, (EOS,))


@pytest.fixture(scope="module")
def embedded():
    """The shipped arithmetic policy and 7 left-padded prompts of different widths."""
    tokenizer = load_tokenizer("embedded:tiny-arith")
    prompts = [row["prompt"] for row in ArithmeticTask(7, seed=3).rows()]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    mask = encoded["attention_mask"].bool()
    assert len(set(mask.sum(1).tolist())) > 1  # the rows really are padded differently
    return load_policy("embedded:tiny-arith"), encoded["input_ids"], mask


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The random tiny Llama (it rarely writes EOS, so rows run to the budget) and 5 padded prompts."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 16, (5, 6), generator=generator)
    mask = torch.arange(6) >= torch.tensor([[0], [2], [3], [1], [4]])  # [5, 6] left padding
    return load_policy(tiny_model_dir), ids.masked_fill(~mask, PAD), mask


def assert_same_completions(expected, got):
    assert torch.equal(got.ids, expected.ids)
    assert torch.equal(got.mask, expected.mask)
    assert torch.equal(got.truncated, expected.truncated)


def assert_consistent(completions):
    """Masks and flags are what `completion_mask_from_ids` says of the ids; padding is pad with log-prob 0."""
    mask, truncated = completion_mask_from_ids(completions.ids, [EOS])
    assert torch.equal(completions.mask, mask)
    assert torch.equal(completions.truncated, truncated)
    assert (completions.ids[~mask] == PAD).all()
    assert (completions.logps[~mask] == 0).all()


@pytest.mark.parametrize("budget", [2, 8])
def test_greedy_tokens_equal_the_hf_engine_on_the_embedded_policy(embedded, budget):
    model, ids, mask = embedded
    expected = HFEngine(model).generate(ids, mask, sampling(budget))
    got = StaticCacheEngine(model, compile=False).generate(ids, mask, sampling(budget))
    assert_same_completions(expected, got)
    assert_consistent(got)
    assert (got.logps == 0).all()  # greedy draws from a point mass
    lengths = got.mask.sum(1)
    if budget == 2:
        assert got.truncated.any() and not got.truncated.all()  # some rows hit the budget
    else:
        assert len(set(lengths.tolist())) > 1 and not got.truncated.any()  # rows end at different steps


@pytest.mark.parametrize("stop_check_interval", [1, 3, 16])
def test_greedy_tokens_equal_the_hf_engine_on_a_random_llama(tiny, stop_check_interval):
    model, ids, mask = tiny
    expected = HFEngine(model).generate(ids, mask, sampling(12))
    engine = StaticCacheEngine(model, compile=False, stop_check_interval=stop_check_interval)
    got = engine.generate(ids, mask, sampling(12))
    assert_same_completions(expected, got)
    assert_consistent(got)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_sampled_logps_are_those_the_training_forward_computes(embedded, tiny, temperature, top_p):
    for model, ids, mask in (embedded, tiny):
        torch.manual_seed(0)
        got = StaticCacheEngine(model, compile=False).generate(ids, mask, sampling(10, temperature, top_p))
        assert_consistent(got)
        scored, _ = completion_logps(model, ids, mask, got.ids, got.mask, temperature, with_entropy=False)
        assert torch.allclose(got.logps[got.mask], scored[got.mask], atol=1e-5)
        assert (got.logps[got.mask] <= 0).all() and (got.logps[got.mask] < 0).any()


def test_the_same_seed_gives_the_same_samples(tiny):
    model, ids, mask = tiny
    engine = StaticCacheEngine(model, compile=False)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(engine.generate(ids, mask, sampling(10, temperature=1.0)))
    assert torch.equal(runs[0].ids, runs[1].ids) and torch.equal(runs[0].logps, runs[1].logps)
    assert not torch.equal(runs[0].ids, runs[2].ids)


def test_budget_of_one_token(embedded):
    model, ids, mask = embedded
    got = StaticCacheEngine(model, compile=False).generate(ids, mask, sampling(1))
    assert_same_completions(HFEngine(model).generate(ids, mask, sampling(1)), got)


def test_shapes_in_one_bucket_reuse_its_cache(tiny):
    model, ids, mask = tiny
    engine = StaticCacheEngine(
        model, compile=False, row_buckets=(4, 8), length_buckets=(16, 32), max_buckets=2
    )
    engine.generate(ids, mask, sampling(4))  # 5 rows -> 8, 6 + 4 -> 16
    engine.generate(ids[:3], mask[:3], sampling(8))  # 3 rows -> 4: a second bucket
    engine.generate(ids[:4], mask[:4], sampling(10))  # 4 rows, 6 + 10 = 16: the second again
    assert engine.allocations == 2
    engine.generate(ids, mask, sampling(9))  # 8 x 16 again
    assert engine.allocations == 2
    engine.generate(ids, mask, sampling(11))  # 8 x 32: evicts the least recently used (4 x 16)
    engine.generate(ids[:4], mask[:4], sampling(2))
    assert engine.allocations == 4


def test_bucket_sizes():
    assert [bucket_size(n, (4, 8)) for n in (1, 4, 5, 8, 9, 17)] == [4, 4, 8, 8, 16, 24]
    with pytest.raises(ValueError, match="length_buckets"):
        StaticCacheEngine(torch.nn.Linear(1, 1), length_buckets=(64, 32))


def test_a_forward_without_a_cache_argument_is_refused():
    with pytest.raises(ValueError, match=r"needs a forward that takes `cache=`.*use rollout_engine='hf'"):
        StaticCacheEngine(torch.nn.Linear(1, 1))


def test_updated_weights_are_used_by_the_next_call(tiny):
    model, ids, mask = tiny
    model = load_policy(model.name_or_path)  # a copy this test may change
    engine = StaticCacheEngine(model, compile=False)
    before = engine.generate(ids, mask, sampling(8))
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    scored, _ = completion_logps(model, ids, mask, before.ids, before.mask, with_entropy=False)
    scored[before.mask].sum().backward()  # push the greedy tokens up a lot: the argmax moves
    optimizer.step()
    engine.weights_changed()
    after = engine.generate(ids, mask, sampling(8))
    assert not torch.equal(before.ids, after.ids)
    assert_same_completions(HFEngine(model).generate(ids, mask, sampling(8)), after)


def test_sharded_policies_are_refused_with_a_pointer_to_the_hf_engine(tiny):
    with pytest.raises(ValueError, match="rollout_engine='hf'"):
        build_engine("static", tiny[0], sharded=True)
    assert ENGINES["static"] is StaticCacheEngine
    assert isinstance(build_engine("static", tiny[0], options={"compile": False}), StaticCacheEngine)
    with pytest.raises(ValueError, match="do not fit"):
        build_engine("static", tiny[0], options={"buckets": 3})


def lora_policy():
    """The embedded policy with a LoRA adapter whose weights are not zero (so it changes the completions)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
    )  # fmt: skip
    return peft.get_peft_model(load_policy("embedded:tiny-arith"), config)


def test_lora_policy(embedded):
    model, ids, mask = embedded
    policy = lora_policy()
    got = StaticCacheEngine(policy, compile=False).generate(ids, mask, sampling(8))
    assert_same_completions(HFEngine(policy).generate(ids, mask, sampling(8)), got)
    assert not torch.equal(
        got.ids, HFEngine(model).generate(ids, mask, sampling(8)).ids
    )  # the adapter counts


def test_the_sampler_draws_from_softmax_over_temperature(tiny):
    """First tokens of 4096 rows on fixed logits: frequencies match softmax(logits / T) (and the cut)."""
    rows = 4096
    cache = meta_cache(tiny[0].config, rows, 4, torch.float32)
    place(cache, torch.zeros(kv_numel(cache)))
    state = Bucket(cache, rows, 4, torch.device("cpu"))
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0]).expand(rows, 5)
    for top_p, kept in ((1.0, 5), (0.8, 3)):  # 0.8: the two least likely (mass 0.10) go
        state.load(torch.ones(rows, 1, dtype=torch.bool), SamplingConfig(2, 1.5, top_p, PAD, (9,)))
        torch.manual_seed(0)
        _pick(logits, state, greedy=False, nucleus=top_p < 1)
        probs = torch.softmax(logits[0] / 1.5, -1)
        expected = torch.zeros(5)
        order = probs.argsort(descending=True)[:kept]
        expected[order] = probs[order] / probs[order].sum()
        frequencies = torch.bincount(state.tokens[:, 0], minlength=5).float() / rows
        assert torch.allclose(frequencies, expected, atol=0.025)  # ~4 standard errors
        assert torch.allclose(state.logps[:, 0], probs.log()[state.tokens[:, 0]])


@settings(max_examples=60)
@given(
    logits=st.lists(st.floats(-5, 5), min_size=2, max_size=12),
    top_p=st.floats(0.05, 0.99),
)
def test_nucleus_keeps_the_smallest_top_set_with_mass_at_least_top_p(logits, top_p):
    logprobs = torch.tensor(logits).log_softmax(-1)[None]  # [1, V]
    kept = _nucleus(logprobs, torch.tensor(top_p))[0] > float("-inf")  # [V]
    probs = logprobs[0].exp()
    assert probs[kept].min() >= torch.cat([probs[~kept], torch.zeros(1)]).max()  # the most likely tokens
    assert probs[kept].sum() >= top_p - 1e-5 or kept.sum() == 1
    without_smallest = probs[kept].sum() - probs[kept].min()
    assert kept.sum() == 1 or without_smallest < top_p + 1e-5  # none of them could go


@pytest.mark.slow
def test_compiled_step_equals_eager_and_hf(tiny):
    """The compiled step: same greedy tokens as hf, one graph per bucket reused, updated weights seen."""
    from torch._dynamo.utils import counters

    model, ids, mask = tiny
    model = load_policy(model.name_or_path)
    engine = StaticCacheEngine(model, compile=True)
    assert_same_completions(
        HFEngine(model).generate(ids, mask, sampling(8)), engine.generate(ids, mask, sampling(8))
    )
    graphs = counters["stats"]["unique_graphs"]
    engine.generate(ids, mask, sampling(12))  # 8 rows x 64 slots again: no new graph, no new cache
    assert counters["stats"]["unique_graphs"] == graphs and engine.allocations == 1
    engine.generate(ids[1:], mask[1:], sampling(12))  # 4 rows: a new bucket, compiled once
    assert counters["stats"]["unique_graphs"] == graphs + 1 and engine.allocations == 2
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1.5)  # in place, as an optimizer step
    assert_same_completions(
        HFEngine(model).generate(ids, mask, sampling(8)), engine.generate(ids, mask, sampling(8))
    )
    torch.manual_seed(0)
    got = engine.generate(ids, mask, sampling(8, temperature=1.0, top_p=0.9))
    scored, _ = completion_logps(model, ids, mask, got.ids, got.mask, 1.0, with_entropy=False)
    assert torch.allclose(got.logps[got.mask], scored[got.mask], atol=1e-5)
    assert_consistent(got)


@pytest.mark.slow
def test_compiled_step_on_a_lora_policy_in_train_mode(embedded):
    _, ids, mask = embedded
    policy = lora_policy().train()  # as during training
    got = StaticCacheEngine(policy, compile=True).generate(ids, mask, sampling(8))
    assert_same_completions(HFEngine(policy).generate(ids, mask, sampling(8)), got)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_and_logps_equal_hf_under_each_accepted_attention_backend(
    tiny_model_dir, attention, temperature
):
    """Greedy tokens equal `hf`'s; sampled ones carry the log-probs the training forward computes."""
    model = load_policy(tiny_model_dir, attn_implementation=attention)
    assert model.config._attn_implementation == attention
    generator = torch.Generator().manual_seed(1)
    mask = torch.arange(6) >= torch.tensor([[0], [2], [3], [1], [4]])
    ids = torch.randint(3, 16, (5, 6), generator=generator).masked_fill(~mask, PAD)
    torch.manual_seed(0)
    got = StaticCacheEngine(model, compile=False).generate(ids, mask, sampling(12, temperature))
    assert_consistent(got)
    if temperature == 0:
        assert_same_completions(HFEngine(model).generate(ids, mask, sampling(12)), got)
    else:
        scored, _ = completion_logps(model, ids, mask, got.ids, got.mask, temperature, with_entropy=False)
        assert torch.allclose(got.logps[got.mask], scored[got.mask], atol=1e-5)


def test_the_attention_mask_marks_exactly_the_written_slots(tiny):
    """Prompt slots as the prompt's mask says, then one more valid slot per decode step; none beyond."""
    model, ids, mask = tiny
    engine = StaticCacheEngine(model, compile=False, stop_check_interval=100)
    engine.generate(ids, mask, sampling(5))
    (state,) = engine._buckets.values()
    width = ids.shape[1]
    assert torch.equal(state.attention_mask[:5, :width], mask)
    assert state.attention_mask[:, width : width + 4].all()  # the 4 tokens fed back after the first
    assert not state.attention_mask[:, width + 4 :].any()


@pytest.mark.parametrize("attention", ["flash_attention_2", "flex_attention"])
def test_other_attention_backends_are_refused_naming_the_fix(tiny, attention):
    model = tiny[0]
    model.config._attn_implementation = attention
    try:
        with pytest.raises(
            ValueError, match="set model.attn_implementation: sdpa, or use rollout_engine='hf'"
        ):
            StaticCacheEngine(model, compile=False)
    finally:
        model.config._attn_implementation = "sdpa"


def test_every_bucket_shares_one_kv_arena_sized_by_the_warm_up(tiny):
    """The warm-up allocates the arena for the largest call; later buckets are views of it (no growth), and
    their completions are those of a fresh engine."""
    model, ids, mask = tiny
    engine = StaticCacheEngine(model, compile=False, row_buckets=(2, 8), length_buckets=(16, 32))
    engine.warm_up([(3, 6, sampling(4)), (5, 6, sampling(20))])  # 2 x 16 and 8 x 32 slots
    config = model.config
    slot_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * 4 * (config.hidden_size // 4)
    assert engine.cache_bytes == 8 * 32 * slot_bytes and engine.allocations == 2
    arena = engine._arena
    for rows, budget in ((5, 20), (2, 4), (5, 4)):
        got = engine.generate(ids[:rows], mask[:rows], sampling(budget))
        expected = StaticCacheEngine(model, compile=False).generate(ids[:rows], mask[:rows], sampling(budget))
        assert_same_completions(expected, got)
    assert engine._arena is arena and engine.cache_bytes == 8 * 32 * slot_bytes
    assert engine.allocations == 3  # 8 x 16 was new; 8 x 32 and 2 x 16 came from the warm-up
    for bucket in engine._buckets.values():
        keys = bucket.cache.layers[0].keys
        assert keys.data_ptr() == arena.data_ptr()


def flash_like_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Flash attention's rule on CPU: tokens outside the 2D mask are dropped (unpadding), then the causal rule
    aligns the queries with the last valid keys (bottom right): a one-token query sees every valid key."""
    batch, heads, queries, dim = query.shape
    key = key.repeat_interleave(heads // key.shape[1], dim=1)  # [B, H, K, D]
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
    valid = (
        torch.ones(batch, key.shape[2], dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    )  # [B, K]
    rank = valid.long().cumsum(-1) - 1  # [B, K] a key's place among the valid ones
    if queries == key.shape[2]:  # no cache: queries are unpadded with the keys, each sees itself and before
        last = rank.masked_fill(~valid, -1)  # [B, Q]
    else:  # queries follow the cached keys: the last one sees every valid key
        last = valid.sum(-1, keepdim=True) - queries + torch.arange(queries)  # [B, Q]
    allowed = valid[:, None, :] & (rank[:, None, :] <= last[:, :, None])  # [B, Q, K]
    scores = (query @ key.transpose(-1, -2)) * (scaling or dim**-0.5)  # [B, H, Q, K]
    weights = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    return (weights @ value).transpose(1, 2).contiguous(), weights  # padding queries see nothing: 0


def test_the_exact_mask_suits_a_kernel_with_no_causal_rule_for_one_token(tiny_model_dir, monkeypatch):
    """Flash attention keeps only the 2D mask; under a CPU stand-in of its rule the static engine's tokens
    still equal hf's, because a slot is valid only once written (with every unwritten slot marked valid, each
    decode step would attend to the zeroed rest of the cache)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("only_2d_mask_test", flash_like_attention)
    AttentionMaskInterface.register("only_2d_mask_test", flash_attention_mask)
    monkeypatch.setattr("exgrpo_pl.engines.static.ATTENTION_BACKENDS", ("only_2d_mask_test",))
    model = load_policy(tiny_model_dir, attn_implementation="only_2d_mask_test")
    generator = torch.Generator().manual_seed(1)
    mask = torch.arange(6) >= torch.tensor([[0], [2], [3], [1], [4]])
    ids = torch.randint(3, 16, (5, 6), generator=generator).masked_fill(~mask, PAD)
    expected = HFEngine(model).generate(ids, mask, sampling(12))
    engine = StaticCacheEngine(model, compile=False)
    assert_same_completions(expected, engine.generate(ids, mask, sampling(12)))
    sdpa = load_policy(tiny_model_dir)  # the stand-in is flash attention's rule, not another model
    assert_same_completions(expected, HFEngine(sdpa).generate(ids, mask, sampling(12)))
    torch.manual_seed(0)
    got = engine.generate(ids, mask, sampling(12, temperature=1.0))
    scored, _ = completion_logps(model, ids, mask, got.ids, got.mask, 1.0, with_entropy=False)
    assert torch.allclose(got.logps[got.mask], scored[got.mask], atol=1e-5)

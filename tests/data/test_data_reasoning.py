"""Tests for the synthetic reasoning task: determinism, families, split, the derivation writer, and the
shipped policy and config on it."""

import itertools
import random
from collections import Counter

import pytest
import torch
from lightning import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from exgrpo_pl.batch import pad_sequences
from exgrpo_pl.data import (
    MAX_DERIVATION_LENGTH,
    REASONING_ALPHABET,
    REASONING_FAMILIES,
    REASONING_OOD_FAMILIES,
    PromptDataModule,
    ReasoningTask,
    write_derivation,
)
from exgrpo_pl.engines.generation import sample_completions
from exgrpo_pl.models import load_policy, load_tokenizer
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import ReasoningReward
from exgrpo_pl.rewards.reasoning import parse_terms
from exgrpo_pl.step.rollout import completion_logps

ROWS = ReasoningTask().rows()


def test_deterministic_and_ids_stable():
    a, b = ReasoningTask(num_questions=500, seed=3), ReasoningTask(num_questions=500, seed=3)
    assert a.rows() == b.rows() and len(a) == 500
    assert [row["id"] for row in a.rows()] == list(range(500))
    assert a.rows() != ReasoningTask(num_questions=500, seed=4).rows()
    # Fewer questions: the first ones of the same stream.
    assert ReasoningTask(num_questions=300, seed=3).rows() == a.rows()[:300]


def test_default_pool_is_tens_of_thousands_of_distinct_questions():
    prompts = [row["prompt"] for row in ROWS]
    assert len(prompts) == 20000 and len(set(prompts)) == len(prompts)


def test_rows_are_sums_within_the_alphabet():
    for row in ROWS:
        assert set(row["prompt"] + row["answer"]) <= set(REASONING_ALPHABET)
        assert row["prompt"].endswith("=")
        assert int(row["answer"]) == sum(parse_terms(row["prompt"]))


def test_every_family_present_with_its_meaning():
    counts = Counter(row["domain"] for row in ROWS)
    assert set(counts) == set(REASONING_FAMILIES)
    assert counts["add2_1d"] == 100  # every one-digit pair, then the family is exhausted
    for row in ROWS:
        family, terms = row["domain"], parse_terms(row["prompt"])
        assert len(terms) == int(family[3])
        low, high = (0, 9) if family.endswith("1d") else (10, 99)
        assert all(low <= abs(t) <= high for t in terms)
        assert terms[0] >= 0
        assert ("-" in row["prompt"]) == family.startswith("mix")


def test_the_out_of_distribution_families_are_larger_numbers_drawn_only_when_named():
    assert not set(REASONING_OOD_FAMILIES) & set(REASONING_FAMILIES)
    assert not {row["domain"] for row in ROWS} & set(REASONING_OOD_FAMILIES)
    rows = ReasoningTask(num_questions=600, seed=1, families=REASONING_OOD_FAMILIES).rows()
    assert {row["domain"] for row in rows} == set(REASONING_OOD_FAMILIES)
    reward, rng = ReasoningReward(check_steps=True), random.Random(0)
    for row in rows:
        terms = parse_terms(row["prompt"])
        assert len(terms) == int(row["domain"][3]) and all(100 <= abs(t) <= 999 for t in terms)
        assert ("-" in row["prompt"]) == row["domain"].startswith("mix")
        derivation = write_derivation(row["prompt"], rng=rng)
        assert len(derivation) <= MAX_DERIVATION_LENGTH  # fits the budget the policy trains with
        assert reward([row["prompt"]], [derivation], answer=[row["answer"]]) == [1.0]


def test_families_select():
    rows = ReasoningTask(num_questions=150, families=["add2_1d", "mix3_2d"]).rows()
    assert {row["domain"] for row in rows} == {"add2_1d", "mix3_2d"}


def test_split_is_deterministic_disjoint_and_stratified():
    task = ReasoningTask(num_questions=2000)
    train, val = task.split(0.1)
    assert (train, val) == task.split(0.1)
    train_ids, val_ids = {r["id"] for r in train}, {r["id"] for r in val}
    assert not train_ids & val_ids and len(train_ids | val_ids) == 2000
    assert abs(len(val) - 200) <= len(REASONING_FAMILIES)
    assert {r["domain"] for r in val} == set(REASONING_FAMILIES)
    assert task.split(0.0)[1] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_questions": 0}, "num_questions"),
        ({"families": ["mul"]}, "unknown family 'mul'"),
        ({"families": []}, "no families"),
        ({"num_questions": 150, "families": ["add2_1d"]}, "hold only 100"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReasoningTask(**kwargs)


def test_writer_examples():
    assert write_derivation("12-7+30=", order=[0, 1, 2]) == "12-7=5;5+30=35"
    assert write_derivation("12-7+30=", order=[1, 2, 0]) == "-7+30=23;23+12=35"
    assert write_derivation("4+5=", order=[1, 0]) == "5+4=9"
    rng_a, rng_b = random.Random(1), random.Random(1)
    assert [write_derivation("1+2+3+4=", rng=rng_a) for _ in range(5)] == [
        write_derivation("1+2+3+4=", rng=rng_b) for _ in range(5)
    ]
    with pytest.raises(ValueError, match=r"order \[0, 0\] is not a permutation of the 2 terms"):
        write_derivation("4+5=", order=[0, 0])


def test_the_writer_always_verifies_and_stays_short():
    reward = ReasoningReward(check_steps=True)
    lengths = []
    for row in ROWS[::20]:
        num_terms = len(parse_terms(row["prompt"]))
        orders = list(itertools.permutations(range(num_terms)))
        derivations = [write_derivation(row["prompt"], order=order) for order in orders]
        n = len(orders)
        assert reward([row["prompt"]] * n, derivations, answer=[row["answer"]] * n) == [1.0] * n
        if len(set(parse_terms(row["prompt"]))) == num_terms:
            assert len(set(derivations)) == n  # distinct terms: every order reads differently
        lengths += [len(d) for d in derivations]
    assert max(lengths) <= MAX_DERIVATION_LENGTH and sorted(lengths)[len(lengths) * 9 // 10] <= 24
    assert len(write_derivation("9-9-9-9=", order=[1, 2, 3, 0])) == MAX_DERIVATION_LENGTH  # the longest


def sample(prompts, max_new_tokens=MAX_DERIVATION_LENGTH + 1):
    """One T = 1 completion of the shipped policy per prompt: `(texts, mean token entropies [N])`."""
    tokenizer, policy = load_tokenizer("embedded:tiny-reasoning"), load_policy("embedded:tiny-reasoning")
    ids, mask = pad_sequences(
        [torch.tensor(tokenizer(p)["input_ids"]) for p in prompts], left=True, pad_value=0
    )
    completion_ids, completion_mask, _ = sample_completions(
        policy, ids, mask, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
    )  # fmt: skip
    with torch.no_grad():
        _, entropy = completion_logps(policy, ids, mask, completion_ids, completion_mask)  # [N, C]
    mean_entropy = (entropy * completion_mask).sum(1) / completion_mask.sum(1)  # [N]
    return tokenizer.batch_decode(completion_ids, skip_special_tokens=True), mean_entropy


def test_the_shipped_policy_is_right_in_several_ways_with_different_entropies():
    torch.manual_seed(0)
    prompt = "3+5+2="
    texts, entropy = sample([prompt] * 64)
    scores = ReasoningReward(check_steps=True)([prompt] * 64, texts, ["10"] * 64)
    right = [i for i, score in enumerate(scores) if score]
    assert len({texts[i] for i in right}) >= 3
    assert len({round(entropy[i].item(), 4) for i in right}) >= 3


@pytest.mark.slow
def test_the_shipped_policy_starts_weak_easy_families_first():
    torch.manual_seed(0)
    _, val = ReasoningTask(num_questions=20000).split(0.025)
    texts, _ = sample([row["prompt"] for row in val])
    scores = ReasoningReward(check_steps=True)([r["prompt"] for r in val], texts, [r["answer"] for r in val])
    by_family = {f: [s for s, r in zip(scores, val) if r["domain"] == f] for f in REASONING_FAMILIES}
    rate = {f: sum(s) / len(s) for f, s in by_family.items()}
    assert 0.15 <= sum(scores) / len(scores) <= 0.55
    assert rate["add3_1d"] > rate["add3_2d"] and rate["mix3_1d"] > rate["mix3_2d"]


def test_a_trainer_run_on_the_task_with_the_embedded_policy(tmp_path):
    seed_everything(0)
    module = ExGRPOModule(
        model_name_or_path="embedded:tiny-reasoning", reward_funcs=[ReasoningReward(check_steps=True)],
        num_generations=4, max_completion_length=29, learning_rate=3e-4,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ReasoningTask(num_questions=400), batch_size=4, val_batch_size=40)
    trainer = Trainer(
        max_steps=3, accelerator="cpu", logger=CSVLogger(tmp_path), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1, val_check_interval=3,
        num_sanity_val_steps=0, default_root_dir=tmp_path,
    )  # fmt: skip
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    assert 0.0 < float(trainer.callback_metrics["val/pass@1"]) < 1.0
    assert 0.0 < float(trainer.logged_metrics["train/reward"]) <= 1.0

"""RolloutCollector: prompts of a plan -> engine -> decoded, scored rows in plan order."""

import warnings

import pytest
import torch

from exgrpo_pl.collect import RolloutCollector
from exgrpo_pl.data import ARITHMETIC_ALPHABET
from exgrpo_pl.engines import Completions, SamplingConfig
from exgrpo_pl.models import build_char_tokenizer
from exgrpo_pl.rewards import ArithmeticReward

TOKENIZER = build_char_tokenizer(ARITHMETIC_ALPHABET)
SAMPLING = SamplingConfig(4, 1.0, 1.0, TOKENIZER.pad_token_id, (TOKENIZER.eos_token_id,))


class ScriptedEngine:
    """Answers every prompt row with the next of `answers` (text), and records what it was given."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.seen = []

    def generate(self, prompt_ids, prompt_mask, sampling):
        self.seen.append((prompt_ids, prompt_mask))
        texts = [self.answers.pop(0) for _ in range(len(prompt_ids))]
        rows = [TOKENIZER(t)["input_ids"] + [TOKENIZER.eos_token_id] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), TOKENIZER.pad_token_id)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        mask = torch.arange(width) < torch.tensor([len(r) for r in rows]).unsqueeze(1)
        return Completions(ids, mask, torch.zeros(len(rows), dtype=torch.bool))

    def weights_changed(self):
        pass


def make_batch():
    return {"prompt": ["1+2=", "10+5="], "question_id": torch.tensor([4, 8]), "answer": ["3", "15"]}


def collect_twice_each(collector, engine, **kwargs):
    batch = make_batch()
    return collector.collect(
        engine, SAMPLING, batch["prompt"], batch["question_id"], [2, 2], {"answer": batch["answer"]}, **kwargs
    )


def test_collect_samples_each_prompt_its_repeats_and_scores_them_in_order():
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward()], max_prompt_length=8)
    engine = ScriptedEngine(["3", "4", "15", "15"])
    out, metrics = collect_twice_each(collector, engine, policy_version=7)
    ((prompt_ids, prompt_mask),) = engine.seen
    assert prompt_ids.shape == (4, 5) and prompt_mask[:2].sum(1).tolist() == [4, 4]  # left-padded to "10+5="
    assert out.question_ids.tolist() == [4, 4, 8, 8]
    assert out.completions == ["3", "4", "15", "15"]
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 1.0] and out.correct.tolist() == [True, False, True, True]
    assert out.answers == ["3", "3", "15", "15"] and out.prompts == ["1+2=", "1+2=", "10+5=", "10+5="]
    assert out.policy_version.tolist() == [7] * 4 and not out.replayed.any()
    assert metrics["generated_tokens"] == 2 + 2 + 3 + 3  # characters plus EOS
    assert metrics["train/rewards/arithmetic/mean"] == 0.75


def test_collect_names_a_per_prompt_argument_of_the_wrong_length():
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward()], max_prompt_length=8)
    prompts, ids = make_batch()["prompt"], make_batch()["question_id"]
    with pytest.raises(ValueError, match="answer has 1 entries for 2 prompts"):
        collector.collect(ScriptedEngine([]), SAMPLING, prompts, ids, [2, 2], {"answer": ["3"]})
    with pytest.raises(ValueError, match="repeats has 3 entries for 2 prompts"):
        collector.collect(ScriptedEngine([]), SAMPLING, prompts, ids, [2, 2, 2])


def test_prompt_lengths_are_checked_for_a_whole_dataset_before_training():
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward()], max_prompt_length=4)
    rows = [{"id": 1, "prompt": "1+2="}, {"id": 2, "prompt": "10+5="}]
    with pytest.raises(
        ValueError, match="training data: prompt of question_id=2 has 5 tokens > max_prompt_length=4"
    ):
        collector.check_prompts(rows, "training data")
    collector.truncate_prompts = True
    collector.check_prompts(rows, "training data")


def test_a_prompt_the_tokenizer_cannot_encode_is_named_with_its_characters():
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward()], max_prompt_length=64, truncate_prompts=True)
    rows = [{"id": 1, "prompt": "1+2="}, {"id": 7, "prompt": "What is 2 + 3? 🙂"}]
    with pytest.raises(ValueError) as raised:
        collector.check_prompts(rows, "training data", locate=lambda row: f"train.jsonl: line {row['id']}")
    message = str(raised.value)
    assert message.startswith("train.jsonl: line 7: column 'prompt' of question_id=7 holds characters")
    assert "cannot encode: ' ', '?', 'W', 'a', 'h', 'i', 's', 't', '🙂'" in message
    assert "it reads only these characters: '+-0123456789='" in message


class ClippingEngine(ScriptedEngine):
    """A scripted engine whose rows are flagged as having run out of budget where `clipped` says."""

    def __init__(self, answers, clipped):
        super().__init__(answers)
        self.clipped = clipped

    def generate(self, prompt_ids, prompt_mask, sampling):
        out = super().generate(prompt_ids, prompt_mask, sampling)
        out.truncated = torch.tensor(self.clipped)
        return out


@pytest.mark.parametrize(
    "clipped, warns", [([True, True, True, False], True), ([True, True, False, False], False)]
)
def test_a_first_batch_mostly_clipped_warns_once_naming_the_stop_ids(clipped, warns):
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward()], max_prompt_length=8)
    engine = ClippingEngine(["3"] * 8, clipped)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collect_twice_each(collector, engine)
        engine.clipped = [True] * 4
        collect_twice_each(collector, engine)  # not the first batch: silent
    messages = [str(w.message) for w in caught if "without a stop token" in str(w.message)]
    if warns:
        assert len(messages) == 1
        assert "75% of the first batch" in messages[0] and "stop ids [2]" in messages[0]
        assert "stop_token_ids" in messages[0]
    else:
        assert messages == []

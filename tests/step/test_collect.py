"""RolloutCollector: prompts of a plan -> engine -> decoded, scored rows in plan order; message-list prompts
(rendered with the chat template, conversational completions for the reward functions), in a real run too."""

import types
import warnings

import pytest
import torch
from conftest import VERL, tiny_module
from lightning.pytorch import Trainer

from exgrpo_pl.data import ARITHMETIC_ALPHABET, PromptDataModule
from exgrpo_pl.engines import Completions, SamplingConfig
from exgrpo_pl.models import build_char_tokenizer
from exgrpo_pl.rewards import REWARD_KEYWORDS, ArithmeticReward, FormatReward
from exgrpo_pl.step.collect import RolloutCollector

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


def test_a_prompt_whose_completion_runs_past_the_models_positions_is_named_with_both_numbers():
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward()], max_prompt_length=8)
    rows = [{"id": 1, "prompt": "1+2="}, {"id": 2, "prompt": "10+5="}]
    collector.check_prompts(rows, "training data")  # no limit known: nothing to check
    collector.context_window = (11, 16)
    with pytest.raises(ValueError, match=r"question_id=2 has 5 tokens, .*=11 .* reach 16 tokens, .*=15:"):
        collector.context_window = (11, 15)
        collector.check_prompts(rows, "training data")
    collector.context_window = (11, 16)
    collector.check_prompts(rows, "training data")
    collector.max_prompt_length, collector.truncate_prompts = 4, True  # counted as truncated: 4 tokens
    collector.context_window = (11, 15)
    collector.check_prompts(rows, "training data")
    collector.context_window = (11, None)  # a config without max_position_embeddings
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


# Message-list prompts (TRL's conversational format, the paper's verl data)

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the contents, back to back
SYSTEM_AND_USER = [{"role": "system", "content": "1="}, {"role": "user", "content": "2+3="}]


class RecordingTokenizer:
    """`tokenizer`, recording the texts and `add_special_tokens` of each call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, texts, **kwargs):
        self.calls.append((texts, kwargs["add_special_tokens"]))
        return self.tokenizer(texts, **kwargs)


def newline_tokenizer(chat_template):
    """The arithmetic alphabet and a newline, with `chat_template` (None: no template)."""
    tokenizer = build_char_tokenizer(ARITHMETIC_ALPHABET + "\n")
    tokenizer.chat_template = chat_template
    return RecordingTokenizer(tokenizer)


def char_ids(text):
    return newline_tokenizer(None).tokenizer(text)["input_ids"]


def test_a_message_prompt_is_rendered_with_the_tokenizers_chat_template():
    tokenizer = newline_tokenizer(TEMPLATE)
    collector = RolloutCollector(tokenizer, [ArithmeticReward()], max_prompt_length=16)
    assert collector._token_ids([SYSTEM_AND_USER, "1+2="]) == [char_ids("1=2+3="), char_ids("1+2=")]
    # Text as before (chat_template off: as it is, special tokens added); the template writes its own.
    assert tokenizer.calls == [(["1+2="], True), (["1=2+3="], False)]
    tokenizer.calls.clear()
    collector.chat_template = True  # now a text prompt is one user message of the template too
    assert collector._token_ids(["1+2=", SYSTEM_AND_USER]) == [char_ids("1+2="), char_ids("1=2+3=")]
    assert tokenizer.calls == [(["1+2=", "1=2+3="], False)]


def test_without_a_chat_template_a_message_prompts_contents_are_joined_with_newlines():
    tokenizer = newline_tokenizer(None)
    collector = RolloutCollector(tokenizer, [ArithmeticReward()], max_prompt_length=16)
    assert collector._token_ids([SYSTEM_AND_USER]) == [char_ids("1=\n2+3=")]
    assert tokenizer.calls == [(["1=\n2+3="], True)]


def test_message_prompts_are_checked_before_training_and_named_by_their_last_message():
    collector = RolloutCollector(newline_tokenizer(None), [ArithmeticReward()], max_prompt_length=6)
    rows = [{"id": 1, "prompt": [{"role": "user", "content": "1+2="}]}, {"id": 3, "prompt": SYSTEM_AND_USER}]
    with pytest.raises(
        ValueError,
        match=r"^training data: prompt of question_id=3 has 7 tokens > max_prompt_length=6 "
        r"\(truncate_prompts: true keeps the end\): '2\+3='$",
    ):
        collector.check_prompts(rows, "training data")
    # The joining newline is a character this tokenizer cannot read: the message says so.
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward()], max_prompt_length=64)
    with pytest.raises(ValueError) as raised:
        collector.check_prompts(rows, "training data", locate=lambda row: f"train.parquet: row {row['id']}")
    message = str(raised.value)
    assert message.startswith("train.parquet: row 3: column 'prompt' of question_id=3 holds characters")
    assert "cannot encode: '\\n'; it reads only these characters: '+-0123456789='" in message
    assert message.endswith(": '2+3='")


class RecordingReward:
    """Records the prompts, completions and columns each call gets; scores 0.0."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, **columns):
        self.calls.append((prompts, completions, columns))
        return [0.0] * len(completions)


def test_reward_functions_get_conversational_completions_for_message_prompts():
    recorder = RecordingReward()
    collector = RolloutCollector(TOKENIZER, [ArithmeticReward(), recorder], max_prompt_length=8)
    engine = ScriptedEngine(["3", "4", "15", "15"])
    messages = [{"role": "user", "content": "1+2="}]
    out, _ = collector.collect(
        engine, SAMPLING, [messages, "10+5="], torch.tensor([4, 8]), [2, 2], {"answer": ["3", "15"]}
    )
    ((prompts, completions, columns),) = recorder.calls
    assert prompts == [messages, messages, "10+5=", "10+5="]
    assert completions == [
        [{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}], "15", "15",
    ]  # fmt: skip
    assert columns["answer"] == ["3", "3", "15", "15"]
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 1.0]  # the shipped verifier reads both kinds
    assert out.completions == ["3", "4", "15", "15"] and out.prompts == prompts  # the rollouts keep the text
    ((prompt_ids, prompt_mask),) = engine.seen
    assert TOKENIZER.decode(prompt_ids[0][prompt_mask[0]]) == "1+2="


class ConversationRecorder(RecordingReward):
    """Records what it gets, as `RecordingReward`, in a real run: the trainer's process calls it directly."""

    in_process = True


def test_a_training_run_on_the_papers_data_gives_reward_functions_conversations(verl_model_dir, tmp_path):
    recorder = ConversationRecorder()
    module = tiny_module(verl_model_dir, reward_funcs=[FormatReward(r"[0-9].*"), recorder])
    data = PromptDataModule(
        train_path=str(VERL), prompt_column="prompt", answer_column="reward_model.ground_truth",
        domain_column="data_source", drop_system_prompt=True, val_fraction=0.25, batch_size=4, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=1, limit_val_batches=1, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2
    assert len(recorder.calls) == 4  # a sanity validation batch, two training steps, the epoch's validation
    for prompts, completions, columns in recorder.calls:
        for prompt, completion in zip(prompts, completions, strict=True):
            assert [message["role"] for message in prompt] == ["user"]  # the system prompt was dropped
            assert isinstance(completion, list) and len(completion) == 1
            assert set(completion[0]) == {"role", "content"} and completion[0]["role"] == "assistant"
            assert isinstance(completion[0]["content"], str)
        assert set(columns["domain"]) <= {"aime24", "amc23", "math500", "gsm8k"}
        assert all(isinstance(answer, str) for answer in columns["answer"])
        assert {reward_model["style"] for reward_model in columns["reward_model"]} == {"rule"}


def test_reward_functions_get_trls_whole_protocol_and_their_metrics_are_averaged_per_call():
    recorder = RecordingReward()

    def logging_reward(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **columns):
        for ids in completion_ids:
            log_metric("completion_tokens", len(ids))
        log_metric("step_seen", trainer_state.global_step)
        log_extra("token_count", [len(ids) for ids in completion_ids])
        return [0.0] * len(completions)

    collector = RolloutCollector(TOKENIZER, [recorder, logging_reward], max_prompt_length=8)
    engine = ScriptedEngine(["3", "4", "15", "15"])
    state = types.SimpleNamespace(global_step=5, epoch=0.5, max_steps=10)
    out, metrics = collect_twice_each(collector, engine, trainer_state=state)
    ((_, _, kwargs),) = recorder.calls
    eos = TOKENIZER.eos_token_id
    expected_ids = [TOKENIZER(text)["input_ids"] + [eos] for text in ["3", "4", "15", "15"]]
    assert kwargs["completion_ids"] == expected_ids  # no padding, the stop token kept (as TRL's)
    assert kwargs["trainer_state"] is state
    assert set(kwargs) == {"answer", "completion_ids", "trainer_state", "log_extra", "log_metric"}
    assert set(kwargs) - {"answer"} < set(REWARD_KEYWORDS)
    assert metrics["train/completion_tokens"] == (2 + 2 + 3 + 3) / 4  # the mean of the call's values
    assert metrics["train/step_seen"] == 5.0
    assert out.extra == {"token_count": [2, 2, 3, 3]}  # each row's, for the completions table


def test_a_log_extra_column_holds_one_value_per_row_or_is_left_out_with_a_warning():
    def first(prompts, completions, log_extra, **columns):
        log_extra("solution", ["first"] * len(completions))
        log_extra("short", ["x"])
        return [0.0] * len(completions)

    def second(prompts, completions, log_extra, **columns):
        log_extra("solution", ["second"] * len(completions))  # as TRL's two accuracy rewards both do
        return [0.0] * len(completions)

    collector = RolloutCollector(TOKENIZER, [first, second], max_prompt_length=8)
    with pytest.warns(UserWarning, match="logged 1 values of log_extra column 'short' for 4 completions"):
        out, _ = collect_twice_each(collector, ScriptedEngine(["3", "4", "15", "15"]))
    assert out.extra == {"solution": ["second"] * 4}

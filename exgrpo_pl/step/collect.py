"""RolloutCollector: prompts in, scored rollouts out (tokenize, sample with an engine, decode, reward).

`ExGRPOModule` collects its training and validation rollouts with it: what is sampled is its step's plan
(`exgrpo_pl.step.plan`: prompts, how many rollouts of each, their dataset columns), and which engine
samples is the module's choice.

    collector = RolloutCollector(tokenizer, [ArithmeticReward()], max_prompt_length=64)
    fresh, metrics = collector.collect(engine, sampling, prompts, question_ids, repeats=[8] * len(prompts))

A prompt is text or, as in TRL's "conversational" format, a list of chat messages; the model reads such a
list rendered with the tokenizer's chat template, and the reward functions receive it as it is, with each of
its completions as one assistant message (see `RolloutCollector.collect`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch, pad_sequences
from exgrpo_pl.engines import RolloutEngine, SamplingConfig
from exgrpo_pl.rewards import RewardLog, check_rewards, completion_text, compute_rewards
from exgrpo_pl.rewards.base import Prompt

# Prompts tokenized per call when checking a whole dataset's prompts.
_CHECK_CHUNK = 4096


def _preview(prompt: Prompt) -> str:
    """The start of a prompt, for error messages: of its text, or of its last chat message's content (the
    question, in the usual system-then-user layout)."""
    return completion_text(prompt)[:60]


class RolloutCollector:
    """Tokenizes prompts, samples completions with an engine, and scores them with the reward functions.

    Args:
        tokenizer: the policy's tokenizer (left padding, a pad token).
        reward_funcs: reward functions (TRL's protocol, see `exgrpo_pl.rewards`).
        reward_weights: one weight per function; None weighs each 1.0.
        max_prompt_length: longest prompt in tokens.
        truncate_prompts: keep a long prompt's last `max_prompt_length` tokens instead of failing.
        chat_template: wrap each text prompt as a user message with the tokenizer's chat template. A
            message-list prompt is rendered with the template whenever the tokenizer has one; without one
            (the embedded tiny models) its messages' contents are joined with "\\n".
        correct_threshold: a rollout is correct when its reward exceeds this.
        reward_timeout_seconds: seconds each reward function may take per call; None: no limit.
    """

    def __init__(
        self,
        tokenizer,
        reward_funcs: Sequence[Callable],
        reward_weights: Sequence[float] | None = None,
        *,
        max_prompt_length: int,
        truncate_prompts: bool = False,
        chat_template: bool = False,
        correct_threshold: float = 0.5,
        reward_timeout_seconds: float | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reward_funcs = list(reward_funcs)
        self.reward_weights = reward_weights
        self.max_prompt_length = max_prompt_length
        self.truncate_prompts = truncate_prompts
        self.chat_template = chat_template
        self.correct_threshold = correct_threshold
        self.reward_timeout_seconds = reward_timeout_seconds
        self._clipping_checked = False
        # (max_completion_length, the model's max_position_embeddings), once the module's setup knows them:
        # `check_prompts` then refuses a prompt whose completion would run past the model's positions.
        self.context_window: tuple[int, int | None] | None = None

    def _render(self, prompt: Prompt) -> tuple[str, bool]:
        """The text the model reads for `prompt`, and whether the tokenizer adds its special tokens to it.

        A text prompt is itself, or with `chat_template` one user message in the tokenizer's chat template.
        A message list is rendered with the tokenizer's chat template (a generation prompt added) when it
        has one; otherwise its messages' contents are joined with "\\n", as plain text is read. A chat
        template writes its own special tokens, so none are added to what it renders.
        """
        if isinstance(prompt, str):
            if not self.chat_template:
                return prompt, True
            prompt = [{"role": "user", "content": prompt}]
        elif self.tokenizer.chat_template is None:
            return "\n".join(message["content"] for message in prompt), True
        return self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True), False

    def _token_ids(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt (text or a message list, see `_render`), in one tokenizer call for each
        setting of `add_special_tokens`."""
        rendered = [self._render(prompt) for prompt in prompts]
        ids: list[list[int]] = [[] for _ in rendered]
        for special in (True, False):
            rows = [row for row, (_, adds) in enumerate(rendered) if adds == special]
            if rows:
                texts = [rendered[row][0] for row in rows]
                for row, row_ids in zip(rows, self.tokenizer(texts, add_special_tokens=special)["input_ids"]):
                    ids[row] = row_ids
        return ids

    def encode(self, prompts: Sequence[Prompt], question_ids: Tensor) -> list[Tensor]:
        """Token ids of each prompt; too long is an error naming the question, unless truncation is on."""
        rows = []
        for ids, prompt, qid in zip(self._token_ids(prompts), prompts, question_ids.tolist()):
            if len(ids) > self.max_prompt_length:
                if not self.truncate_prompts:
                    raise ValueError(self._too_long(qid, len(ids), prompt))
                ids = ids[-self.max_prompt_length :]
            rows.append(torch.tensor(ids, dtype=torch.long))
        return rows

    def check_prompts(
        self, rows: Sequence[dict], source: str, locate: Callable[[dict], str] | None = None
    ) -> None:
        """Raise before training if a dataset row's prompt holds characters the tokenizer cannot encode, is
        longer than `max_prompt_length` tokens (unless `truncate_prompts`), or leaves too few of the model's
        positions for `max_completion_length` (`context_window`, where the model's config has a limit).

        Args:
            rows: dataset rows with "id" and "prompt" (text or a list of chat messages).
            source: what the rows are, for the message (e.g. "training data").
            locate: where a row comes from (file and row), for the message; None names `source` only.
        """
        for start in range(0, len(rows), _CHECK_CHUNK):
            chunk = rows[start : start + _CHECK_CHUNK]
            try:
                token_ids = self._token_ids([row["prompt"] for row in chunk])
            except Exception:  # a tokenizer without an unknown token refuses what it cannot read
                for row in chunk:
                    self._check_encodable(row, locate(row) if locate else source)
                raise  # no single row fails alone: the tokenizer's own error is all there is to say
            for row, ids in zip(chunk, token_ids):
                if len(ids) > self.max_prompt_length and not self.truncate_prompts:
                    where = locate(row) if locate else source
                    raise ValueError(f"{where}: " + self._too_long(row["id"], len(ids), row["prompt"]))
                self._check_window(row, min(len(ids), self.max_prompt_length), locate, source)

    def _check_window(
        self, row: dict, length: int, locate: Callable[[dict], str] | None, source: str
    ) -> None:
        """Raises ValueError naming the row, where it is, and both numbers when a prompt of `length` tokens
        and `max_completion_length` more exceed the model's `max_position_embeddings`: past them a model
        with learned positions fails and a rotary one reads positions it never saw, in silence."""
        if self.context_window is None or self.context_window[1] is None:
            return
        completion, positions = self.context_window
        if length + completion > positions:
            where = locate(row) if locate else source
            raise ValueError(
                f"{where}: the prompt of question_id={row['id']} has {length} tokens, and with "
                f"max_completion_length={completion} its sequences reach {length + completion} tokens, more "
                f"than the model's max_position_embeddings={positions}: lower max_completion_length or "
                f"max_prompt_length (with truncate_prompts), or drop the row: {_preview(row['prompt'])!r}"
            )

    def check_rewards(self) -> None:
        """Raise before training if a reward function cannot run where it will run: in the worker process
        under `reward_timeout_seconds`, where it is sent and loaded now (see
        `exgrpo_pl.rewards.check_rewards`)."""
        check_rewards(self.reward_funcs, self.reward_timeout_seconds)

    def _check_encodable(self, row: dict, where: str) -> None:
        """Raises ValueError naming `where`, the row's question and the characters of its prompt that the
        tokenizer cannot encode, and the characters it can, when its vocabulary is small enough to list.

        The characters are those of the prompt as the model reads it (a message list rendered, see
        `_render`), so a character a chat template or the join of messages adds is named too.
        """
        try:
            self._token_ids([row["prompt"]])
            return
        except Exception as err:
            cause = err
        text, _ = self._render(row["prompt"])
        unreadable = sorted({char for char in text if not self._encodes(char)})
        vocabulary = self.tokenizer.get_vocab()
        readable = ""
        if len(vocabulary) <= 512:
            alphabet = "".join(sorted(token for token in vocabulary if len(token) == 1))
            readable = f"; it reads only these characters: {alphabet!r}"
        raise ValueError(
            f"{where}: column 'prompt' of question_id={row['id']} holds characters the model's tokenizer"
            f" cannot encode: {', '.join(repr(c) for c in unreadable) or '(none alone)'}"
            f"{readable} ({cause}): {_preview(row['prompt'])!r}"
        ) from cause

    def _encodes(self, char: str) -> bool:
        try:
            self.tokenizer(char, add_special_tokens=False)
        except Exception:
            return False
        return True

    def _too_long(self, question_id: int, length: int, prompt: Prompt) -> str:
        return (
            f"prompt of question_id={question_id} has {length} tokens > max_prompt_length="
            f"{self.max_prompt_length} (truncate_prompts: true keeps the end): {_preview(prompt)!r}"
        )

    def _check_clipping(self, truncated: Tensor, sampling: SamplingConfig) -> None:
        """Warn once, on the first batch, when most completions ran out of budget without a stop token.

        That is what a missing stop token looks like (a chat model's end-of-turn token, say): completions
        run on to the budget and are scored on whatever the model wrote after its answer.
        """
        if self._clipping_checked:
            return
        self._clipping_checked = True
        clipped = float(truncated.float().mean()) if truncated.numel() else 0.0
        if clipped > 0.5:
            rank_zero_warn(
                f"{clipped:.0%} of the first batch's completions reached max_completion_length="
                f"{sampling.max_new_tokens} without a stop token (stop ids {list(sampling.eos_token_ids)}); "
                "if the model ends its answers with another token, add its id to the module's stop_token_ids"
            )

    def collect(
        self,
        engine: RolloutEngine,
        sampling: SamplingConfig,
        prompts: Sequence[Prompt],
        question_ids: Tensor,
        repeats: Sequence[int],
        columns: dict[str, list[Any]] | None = None,
        *,
        policy_version: int = 0,
        device: torch.device | str = "cpu",
        trainer_state: Any = None,
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample `repeats[i]` completions of `prompts[i]` and score them.

        Args:
            engine: what samples.
            sampling: budget, temperature, stop tokens.
            prompts: the prompts: strings, or lists of chat messages. The reward functions receive each
                as it is; a message-list prompt's completions reach them as TRL's GRPOTrainer gives them,
                `[{"role": "assistant", "content": text}]`, while the rollouts keep the text.
            question_ids: `[len(prompts)]` long.
            repeats: completions per prompt.
            columns: dataset columns per prompt, the reward functions' keyword arguments.
            policy_version: the step whose policy samples (stored with each row).
            device: where the rows go.
            trainer_state: the run's progress, the reward functions' `trainer_state` (TRL's protocol, see
                `exgrpo_pl.rewards.protocol`); None: not passed.

        Returns:
            The rollouts (`group_size` 1; each prompt's rows next to each other, prompts in order;
                behaviour log-probs, entropy and advantages 0: the training forward computes the first two,
                with the numerics of the importance weights that later divide by them) and step metrics:
                `timing/generation`, `timing/reward`, `train/rewards/{name}/mean`, `generated_tokens`, and
                `train/{name}` for each metric the reward functions logged with `log_metric` (its mean over
                the call, as TRL averages them per step). The rollouts carry what they logged with
                `log_extra` (`RolloutBatch.extra`, shown in `DifficultyMonitor`'s completions table): one
                value per row, the last function's where several logged a column; a column of another length
                is left out with a warning naming it.
        """

        columns = columns or {}
        for name, values in {"question_ids": question_ids, "repeats": repeats, **columns}.items():
            if len(values) != len(prompts):
                raise ValueError(f"collect: {name} has {len(values)} entries for {len(prompts)} prompts")

        def per_row(values: Sequence[Any]) -> list[Any]:  # one entry per prompt -> one per rollout
            return [value for value, times in zip(values, repeats) for _ in range(times)]

        prompt_ids, prompt_mask = pad_sequences(
            per_row(self.encode(prompts, question_ids)),
            left=True,
            pad_value=self.tokenizer.pad_token_id,
        )
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        started = time.perf_counter()
        with torch.no_grad():
            out = engine.generate(prompt_ids, prompt_mask, sampling)
        metrics = {"timing/generation": time.perf_counter() - started}
        metrics["generated_tokens"] = float(out.mask.sum())
        self._check_clipping(out.truncated, sampling)

        started = time.perf_counter()
        completions = self.tokenizer.batch_decode(out.ids, skip_special_tokens=True)
        row_prompts = per_row(prompts)
        row_columns = {key: per_row(values) for key, values in columns.items()}
        # As TRL's GRPOTrainer: a conversational prompt's completion is a conversation, one assistant message.
        reward_completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(row_prompts, completions)
        ]
        # TRL's completion_ids: each completion's tokens up to and including its stop token, no padding.
        completion_ids = [ids[mask].tolist() for ids, mask in zip(out.ids.cpu(), out.mask.cpu())]
        log = RewardLog()
        rewards, per_function = compute_rewards(
            self.reward_funcs, self.reward_weights, row_prompts, reward_completions, row_columns,
            timeout_seconds=self.reward_timeout_seconds, completion_ids=completion_ids,
            trainer_state=trainer_state, log=log,
        )  # fmt: skip
        metrics["timing/reward"] = time.perf_counter() - started
        for name, values in per_function.items():
            metrics[f"train/rewards/{name}/mean"] = float(values.nanmean())
        metrics.update({f"train/{name}": value for name, value in log.means().items()})
        extra = {}
        for column, values in log.extra.items():
            n = len(completions)
            if n and values and len(values) % n == 0:
                extra[column] = values[-n:]  # several functions logged it (TRL's accuracy rewards): the last
            else:
                rank_zero_warn(
                    f"the reward functions logged {len(values)} values of log_extra column {column!r} for {n}"
                    " completions, not one per completion: the completions table leaves it out"
                )

        n = prompt_ids.shape[0]
        rewards = rewards.to(device, torch.float32)
        zeros = torch.zeros(n, device=device)
        row_ids = torch.tensor(per_row(question_ids.tolist()), dtype=torch.long, device=device)
        return RolloutBatch(
            question_ids=row_ids,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=out.ids,
            completion_mask=out.mask,
            behaviour_logps=torch.zeros(out.ids.shape, device=device),  # the training forward's, later
            rewards=rewards,
            correct=rewards > self.correct_threshold,
            entropy=zeros.clone(),
            advantages=zeros,
            policy_version=torch.full((n,), policy_version, device=device, dtype=torch.long),
            replayed=torch.zeros(n, dtype=torch.bool, device=device),
            group_size=1,
            prompts=row_prompts,
            completions=completions,
            answers=[str(a) for a in row_columns.get("answer", [""] * n)],
            domains=row_columns.get("domain"),
            columns=row_columns,
            extra=extra or None,
        ), metrics

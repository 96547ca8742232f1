"""Multiple-choice verifier: the option the completion chose must be the reference option, as the paper's
evaluation scores its out-of-distribution sets (ARC-c, GPQA-diamond, MMLU-Pro).

The official code (ElliottYan/LUFFY, `ExGRPO/eval_scripts/generate_vllm.py`, `oat_evaluate`) grades those
sets with the same grader as math: the content of the completion's last `\\boxed{...}` against the
reference, which is an option label ("C", or "2" for the ARC questions numbered 1-4); its normalization
accepts the label in either case, in parentheses and inside `\\text{}`-like wrappers, and nothing longer
(`\\boxed{C) the text of option C}` is wrong). A completion without a box scores 0.0, even one that ends
with "ANSWER: C" as GPQA's own prompt asks. `boxed_only=False` adds a fallback for models that answer in
words: the last "answer is (X)" / "Answer: X".
"""

from __future__ import annotations

import re
from typing import Any

from exgrpo_pl.rewards.base import AnswerReward, Completion, completion_text
from exgrpo_pl.rewards.math_verify import extract_boxed

# An option label: one letter (A-J in MMLU-Pro, A-D/E elsewhere) or one digit (some ARC questions).
_LABEL = re.compile(r"[A-Za-z]|[1-9]")
# LaTeX wrappers a model puts around a boxed label, which the paper's grader strips too.
_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{(.*)\}", re.DOTALL)
# "answer is (C)", "Answer: C", "ANSWER: C", "**Answer:** C": the label is an upper-case letter or a digit,
# so that "the answer is a prime" chooses nothing, and either in brackets or ending its clause (the text, a
# line or a sentence ends after it), so that the pronoun of "Answer: I think it is B" is no option I.
_ANSWER_PHRASE = re.compile(
    r"(?i:answer)(?:\s+(?i:is))?[\s:*]*"
    r"(?:[(\[]([A-Z]|[1-9])[)\]]|([A-Z]|[1-9])(?=[ \t]*(?:\Z|[\n,;:!?*)\]]|\.(?!\d))))"
)


def option_label(text: str) -> str | None:
    """The option label `text` is, upper-cased: "C" for "C", "c", "(C)", "$\\text{(C)}$"; else None.

    Args:
        text: a boxed answer or a reference answer.
    """
    text = text.replace("$", "").strip()
    while True:
        wrapped = _WRAPPER.fullmatch(text)
        if wrapped is not None:
            text = wrapped.group(1).strip()
        elif text[:1] + text[-1:] in ("()", "[]"):
            text = text[1:-1].strip()
        else:
            break
    return text.upper() if _LABEL.fullmatch(text) else None


class MultipleChoiceReward(AnswerReward):
    """1.0 when the option a completion chose is the `answer` column's option label, else 0.0.

    The chosen option is the last `\\boxed{...}` of the completion (of its text, for a conversational one)
    when it holds one option label (see `option_label`); a completion with no such box chose nothing, unless
    `boxed_only` is False: then it chose the label of its last "answer is (X)" / "Answer: X", a bare label
    only where its clause ends there ("Answer: I think it is B" chooses nothing, not option I).

    Args:
        boxed_only: read the boxed answer only, as the paper does; False adds the answer-phrase fallback.
        name: the name its scores are logged under.

    Raises:
        ValueError: when called with an answer that is not an option label, naming its row.
    """

    # Linear-time work on a bounded completion: nothing for a time limit to stop, so no worker process.
    in_process = True

    def __init__(self, boxed_only: bool = True, name: str = "multiple_choice") -> None:
        self.boxed_only = boxed_only
        self.name = name

    def extract_answer(self, completion: Completion) -> str | None:
        """The option label a completion chose, upper-cased, or None (what majority voting counts).

        Args:
            completion: the model's completion: text, or conversational (see `completion_text`).
        """
        text = completion_text(completion)
        boxed = extract_boxed(text)
        chosen = option_label(boxed) if boxed is not None else None
        if chosen is None and not self.boxed_only:
            phrases = [bracketed or bare for bracketed, bare in _ANSWER_PHRASE.findall(text)]
            chosen = phrases[-1] if phrases else None
        return chosen

    def score(self, completion: str, answer: Any, row: int) -> float:
        expected = option_label(str(answer))
        if expected is None:
            raise ValueError(f"{self.name}: answer {answer!r} of row {row} is not an option label")
        return 1.0 if self.extract_answer(completion) == expected else 0.0

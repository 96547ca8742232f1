"""How concentrated replay is under the paper's Gaussian question selection and under uniform questions.

The learning benchmark finds the paper preset behind its "no question selection" ablation on the embedded
task. This runs both (one seed, the learning benchmark's budget) and counts every replayed question: how
many distinct questions were replayed, how often each, and what share of all replays went to the most
replayed tenth. Prints a table and writes benchmarks/results/replay_concentration.json.

    python benchmarks/replay_concentration.py          # ~5 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from learning import RESULTS, run
from lightning.pytorch import Callback

VARIANTS = ("ExGRPO paper", "no question selection")


class ReplayedQuestions(Callback):
    """Counts the question ids of the replayed rows of every training step."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollouts = outputs["rollouts"]
        self.counts.update(rollouts.question_ids[rollouts.replayed].tolist())


def summary(counts: Counter[int], curve: list[tuple[float, float]]) -> dict[str, float]:
    per_question = sorted(counts.values(), reverse=True)
    top = per_question[: max(1, len(per_question) // 10)]
    return {
        "replays": sum(per_question),
        "distinct_questions": len(per_question),
        "mean_replays_per_question": statistics.mean(per_question),
        "max_replays_per_question": per_question[0],
        "top_tenth_share": sum(top) / sum(per_question),
        "final_val_pass@1": curve[-1][1],
        "best_val_pass@1": max(v for _, v in curve),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=300_000, help="generated tokens per run")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VARIANTS:
            counter = ReplayedQuestions()
            curve = run(name, args.seed, args.budget, Path(tmp) / name.replace(" ", "_"), 2, [counter])
            results[name] = summary(counter.counts, curve)
    keys = list(next(iter(results.values())))
    print(f"\n{'':26s}" + "".join(f"{name:>24s}" for name in results))
    for key in keys:
        print(f"{key:26s}" + "".join(f"{r[key]:24.3f}" for r in results.values()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "replay_concentration.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

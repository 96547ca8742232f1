"""Seed-0 runs of the learning benchmark, dumped as JSON, so that two commits can be compared bit for bit.

A refactor that moves code claims to change no computation; this is how the claim is checked: run this at
the commit before and at the one after, and the two files must be byte-identical (curves, generated tokens
and replay diagnostics; the commit id is left out). Used for the move of the modules into folders
(`ExGRPO paper` and `ExGRPO seed`, now `ExGRPO swap`, on arithmetic, 2504397 against the merge of the move:
identical).

    python scripts/seed_runs.py before.json                   # at the old commit
    python scripts/seed_runs.py after.json && cmp before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from learning import TASKS, VARIANTS, run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--task", choices=TASKS, default="arithmetic")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["ExGRPO paper", "ExGRPO swap"])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the task's)")
    args = parser.parse_args(argv)
    records = {}
    for name in args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            record = run(args.task, name, 0, args.steps, Path(tmp) / "run", threads=1)
        record.pop("commit")  # the one field that differs between two commits by design
        records[name] = record
    args.out.write_text(json.dumps(records, sort_keys=True))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

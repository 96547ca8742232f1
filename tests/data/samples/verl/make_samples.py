"""Writes `verl_math.parquet`: math questions in the layout of the ExGRPO paper's data (verl's), 3 rows from
each of 4 sources.

Each row: `data_source` (the benchmark), `prompt` (a system message, then the question as a user message),
`ability`, `reward_model` (`{"ground_truth": ..., "style": "rule"}`) and `extra_info` (`{"index": ...,
"split": ...}`, the index within its source). Run `python tests/data/samples/verl/make_samples.py` to write
it again next to this file.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."

# (data_source, question, ground truth); the answers are right, and every question is distinct.
QUESTIONS = [
    ("aime24", "Find the remainder when $2^{10}$ is divided by $7$.", "2"),
    ("aime24", "How many positive divisors does $360$ have?", "24"),
    ("aime24", "Find the sum of the positive integers $n < 10$ with $n^2 - 1$ divisible by $8$.", "25"),
    ("amc23", "What is the units digit of $3^{2023}$?", "7"),
    ("amc23", "How many primes are less than $30$?", "10"),
    ("amc23", "What is the area of a triangle with sides $3$, $4$ and $5$?", "6"),
    ("math500", "What is $\\frac{1}{2} + \\frac{1}{4}$?", "\\frac{3}{4}"),
    ("math500", "Simplify $\\sqrt{50}$.", "5\\sqrt{2}"),
    ("math500", "Solve for $x$: $2x + 3 = 11$.", "4"),
    ("gsm8k", "Tom has 3 apples and buys 5 more. How many apples does he have?", "8"),
    ("gsm8k", "A pen costs 2 dollars. How many dollars do 7 pens cost?", "14"),
    ("gsm8k", "Sara reads 12 pages a day. How many pages does she read in 5 days?", "60"),
]


def rows() -> list[dict]:
    """The rows, in the order of `QUESTIONS`."""
    seen: dict[str, int] = {}
    out = []
    for source, question, answer in QUESTIONS:
        index = seen[source] = seen.get(source, -1) + 1
        out.append(
            {
                "data_source": source,
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"ground_truth": answer, "style": "rule"},
                "extra_info": {"index": index, "split": "test"},
            }
        )
    return out


if __name__ == "__main__":
    pq.write_table(pa.Table.from_pylist(rows()), Path(__file__).with_name("verl_math.parquet"))

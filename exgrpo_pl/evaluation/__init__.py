"""Evaluation the way the ExGRPO paper reports it: per set (and per domain inside a set) avg@k, pass@k,
maj@k, greedy pass@1, completion length and the share cut at the length limit (`metrics`), gathered into
one table (`report`).

Plain PyTorch/Python: imports nothing above `exgrpo_pl.batch`; the module's validation and test steps
(`exgrpo_pl.module.evaluation`) feed it.
"""

from exgrpo_pl.evaluation.metrics import ProblemSamples, avg_at_k, majority_correct, pass_at_k, summarize

__all__ = ["ProblemSamples", "avg_at_k", "majority_correct", "pass_at_k", "summarize"]

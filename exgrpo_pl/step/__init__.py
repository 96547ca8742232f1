"""One GRPO training step, in the order it runs: plan the rollouts, generate and score them, assemble the
groups, forward, loss, update.

- `plan`: what a step samples (`plan_rollouts`): the fresh questions and, in mix mode, the replayed ones.
- `collect`: `RolloutCollector`, prompts in, scored rollouts out (tokenize, sample with an engine, reward).
- `assembly`: sampled and replayed rows into groups of K with advantages (`assemble_groups`).
- `sampling`: the same from a sampler of your own (`sample_groups`, `fresh_rollouts`).
- `forward`: what the first forward gives the groups (`record_behaviour`), and replayed rows' loss terms.
- `groups`: the four above as one facade, for a GRPO module of your own.
- `rollout`: per-token log-probs and entropy of completions (`completion_logps`, `score_entropy`), in chunks
  from `logprobs`; `losses`: the GRPO / ExGRPO math as pure functions.
- `update`: `PolicyUpdate`, micro-batched forwards and backwards, clipping and the optimizer step.
- `rollout_memory`: refuses a step whose rollouts cannot fit in the device's memory.

Layer: above the shared basics, the rewards and the rollout engines, which it imports; nothing of the replay
memory (`exgrpo_pl.experience`), the checkpoints, the module or the callbacks. `losses`, `logprobs`,
`rollout` and the group modules need no Lightning (`exgrpo_pl` exports `compute_grpo_loss` and
`compute_entropy` without it), so this file imports nothing: `collect` and `update` do use Lightning.
"""

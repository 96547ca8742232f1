"""Which rollouts a training step generates, and how they and replayed experience become GRPO groups.

The bookkeeping a GRPO step needs to honour `batch["experience"]` (see `exgrpo_pl.contract`), as two pure
functions, so any GRPO module (ours, or your own) trains replay the same way:

    plan = plan_rollouts(batch, num_generations)     # what to sample: plan.prompts x plan.repeats
    fresh = ...                                      # sample and score them: a RolloutBatch, one row each
    rollouts = assemble_groups(plan, fresh, "group") # the groups to train on, with advantages

or, with a sampler of your own (`rollout_fn(prompts, **columns)` returning the prompt/completion ids and masks
and the rewards), the three at once: `rollouts = sample_groups(batch, num_generations, rollout_fn)`. The
step's first forward then gives the fresh rows their behaviour log-probs and entropy (`record_behaviour`),
and `replayed_token_loss` puts the replayed rows' importance-weighted term into the per-token loss.

- No experience: every question of the batch gets K fresh rollouts.
- Mix (the paper): the batch's last `len(experience)` questions give way to the replayed questions. Each
  replayed question gets K-1 fresh rollouts, and its group is its stored trajectory followed by them;
  advantages are computed over all K.
- Swap (the reference description): nothing is generated; the step trains on the replayed rows alone, with
  their stored baseline advantage put on the scale of on-policy ones (`replay_advantages`).

The parts live in `exgrpo_pl.step.plan` (`plan_rollouts`, `RolloutPlan`), `exgrpo_pl.step.assembly`
(`assemble_groups`, `replay_advantages`), `exgrpo_pl.step.sampling` (`sample_groups`, `sample_plan`,
`fresh_rollouts`, `total_reward`) and
`exgrpo_pl.step.forward` (`record_behaviour`, `replayed_token_loss`); import them from here. Plain PyTorch,
no Lightning and no model.
"""

# In the order of a step, which the API page (docs/api/mixin.md) follows.
# isort: off
from exgrpo_pl.step.plan import RESERVED_KEYS, RolloutPlan, dataset_columns, plan_rollouts
from exgrpo_pl.step.assembly import assemble_groups, replay_advantages
from exgrpo_pl.step.sampling import SAMPLED, fresh_rollouts, sample_groups, sample_plan, total_reward
from exgrpo_pl.step.forward import record_behaviour, replayed_token_loss
# isort: on

__all__ = [
    "RESERVED_KEYS",
    "SAMPLED",
    "RolloutPlan",
    "assemble_groups",
    "dataset_columns",
    "fresh_rollouts",
    "plan_rollouts",
    "record_behaviour",
    "replay_advantages",
    "replayed_token_loss",
    "sample_groups",
    "sample_plan",
    "total_reward",
]

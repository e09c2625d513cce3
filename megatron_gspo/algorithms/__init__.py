"""The RL objective and what it is made of (verl's ``core_algos``), as pure functions over tensors:

    objective.py          ``objective(cfg, micro, logp, entropy, normalizer)`` -> (loss, metrics) of one
                          micro-batch: loss mask -> rollout-correction weights -> the policy loss (the
                          trainer's per micro-batch forward -> objective -> backward)
    losses.py             the policy losses (GSPO, GSPO-token, GRPO, SAPO, CISPO, GMPO, LUSPO) and their
                          registry: a new loss is one function decorated with ``@register_policy_loss``
    advantages.py         group-relative advantage estimators and their registry (``@register_advantage``)
    rollout_correction.py TIS / MIS weights between the rollout and the old policy; the mismatch metrics
    overlong.py           DAPO's overlong reward shaping and overlong filtering mask
    dynamic_sampling.py   DAPO's informative-group selection

Nothing here builds a model, talks to other ranks or reads the whole job config: the trainer and the
rollout source call these with tensors.
"""

from megatron_gspo.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    register_advantage,
)
from megatron_gspo.algorithms.losses import (
    POLICY_LOSSES,
    compute_policy_loss,
    get_policy_loss,
    register_policy_loss,
)
from megatron_gspo.algorithms.objective import ObjectiveConfig, loss_units, objective

__all__ = [
    "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "ObjectiveConfig", "compute_policy_loss", "get_advantage_estimator",
    "get_policy_loss", "loss_units", "objective", "register_advantage", "register_policy_loss",
]

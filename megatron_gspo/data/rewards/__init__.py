r"""Rewards: a registry of built-ins, plug-ins by import path, and batch scoring with checked values.

Select a reward with ``reward.name``: a registered name (:func:`registered_rewards`), or
``package.module:function`` (or ``path/to/file.py:function``) for your own. The simple case is a
per-sample function::

    fn(prompt: str, response: str, answer: str | None, **settings) -> float

* ``prompt``: the text the model was conditioned on (after the chat template, if any).
* ``response``: the decoded completion. It may end with (or contain) the end-of-sequence token text,
  e.g. ``<eos>`` or ``<|im_end|>``; built-ins cut at the first one.
* ``answer``: the example's reference answer, or None for data without answers.
* ``settings``: ``reward.kwargs``, checked by key at start-up against what the reward declares
  (settings.py: a settings dataclass, or the keyword parameters of its signature).

A reward that is cheaper a batch at a time (a reward model, a pool of verifiers, a remote service)
implements ``score(batch: RewardBatch) -> rewards`` instead (batch.py; registry.py for the three shapes
a reward can take). ``reward.num_workers`` processes score a per-sample reward in parallel where it
allows (per_sample.py, pool.py), the same numbers in the same row order whatever their number; a stop signal cuts
scoring short within about one sample (runtime.stop.Cancelled: the trainer abandons the step).

It returns a finite number that float32 holds (bool and 0-d tensors/arrays count). Anything else -- an
exception, NaN, inf, 1e300, None, a string -- stops training with a :class:`RewardError` that names
the reward, the sample and a piece of the prompt and response (scoring.py).

Built-ins, one module each:

* ``exact_match`` (exact.py): 1.0 when the response's first line equals the reference answer. The
  reward of the built-in tasks.
* ``digit_match`` (digits.py): the share of positions at which that first line agrees with the answer.
* ``math`` (math.py): math-verify's verdict on the response's final answer against the reference's,
  in child processes with CPU and wall-clock limits (math_verify_worker.py); references it cannot read
  are counted before training (math_reference.py).
* ``reasoning_gym`` (reasoning_gym.py): the task's own verifier, for a ``data.source=reasoning_gym:<task>``
  source.
* ``format`` (format.py): 1.0 when the response has the required shape (a ``<think>`` block, a
  ``\boxed{}``); mostly an additive shaping term (``reward.format_weight``).

The names below are imported from their modules on first use, so that a reward worker process loads
only what it needs (no torch).
"""

from megatron_gspo import lazy_exports

_EXPORTS = {
    # the registry and declarations
    "RewardSpec": "registry",
    "register_reward": "registry",
    "registered_rewards": "registry",
    "resolve_reward": "registry",
    "reward_function": "registry",
    "setting": "settings",
    # the batch interface and scoring
    "BatchReward": "batch",
    "RewardBatch": "batch",
    "SampleFailed": "batch",
    "Reward": "scoring",
    "build_reward": "scoring",
    "compute_rewards": "scoring",
    "RewardError": "scoring",
    "check_reference_answers": "references",
    # the built-ins and what they read of a response
    "exact_match": "exact",
    "digit_match": "digits",
    "MathVerifyReward": "math",
    "math_reward": "math",
    "math_reference_problem": "math_reference",
    "format_reward": "format",
    "reasoning_gym_reward": "reasoning_gym",
    "extract_task_answer": "reasoning_gym",
    "task_reference_problem": "reasoning_gym",
    "EOS_MARKERS": "text",
    "cut_at_eos": "text",
    "first_line": "text",
    "last_boxed": "text",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

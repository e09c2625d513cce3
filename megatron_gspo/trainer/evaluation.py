"""Evaluation during training: greedy accuracy, pass@k and response length on held-out prompts.

Every ``eval.interval`` RL steps and after the last one, the policy answers the held-out prompts
(data.build_eval_prompts) twice: once greedily (``eval/greedy_accuracy``, ``eval/response_length_mean``)
and ``eval.num_samples`` times at ``eval.temperature`` (``eval/pass@k`` by the unbiased estimator,
``eval/sample_accuracy`` = pass@1). A response is correct when its reward (reward.name, without the
overlong penalty) is >= 1: the full score of exact_match and math.

Evaluation leaves training untouched: its sampling noise is keyed by ``eval.seed`` (the
counter-based sampler of sampling.py draws no torch RNG state), it runs no routing capture, and the
trainer reseeds every step anyway; tests/test_evaluation.py checks a run's training metrics are
bit-identical with evaluation on and off. Every rank generates every held-out row (the result needs
no reduction and is the same under any layout; held-out sets are small).

A stop signal cuts an evaluation short (``should_stop``, read in the decode loop and voted on after each
generation): it raises runtime.stop.Cancelled on every rank; the step it follows stands, only its
eval/* metrics are missing, and the trainer goes on to save and stop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from megatron_gspo.generation.generator import Generator
from megatron_gspo.model.oom import explain_oom
from megatron_gspo.data.rewards import compute_rewards
from megatron_gspo.rollout.multiturn import build_multiturn, multiturn_rewards
from megatron_gspo.runtime.stop import Cancelled, raise_together


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, arXiv 2107.03374 eq. 1):
    1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class Evaluator:
    """Runs the held-out evaluation on the training model.

    cfg: the JobConfig; prompts: the held-out data.Prompt list; gen_cfg: the generation section with
    stop / pad ids filled in (its max_new_tokens, top_k, top_p apply); length_policy: how many held-out
    records data.overlong_prompt_policy dropped and cut (data.HeldOutPrompts), reported with every
    evaluation like the training prompts' data/dropped_prompts."""

    def __init__(self, cfg, state, model, tokenizer, reward_fn, gen_cfg, prompts, length_policy=(0, 0)) -> None:
        self.cfg, self.ecfg, self.state, self.model = cfg, cfg.eval, state, model
        self.tokenizer, self.reward_fn, self.prompts = tokenizer, reward_fn, prompts
        self.length_metrics = {"eval/dropped_prompts": float(length_policy[0]),
                               "eval/truncated_prompts": float(length_policy[1])}
        self.greedy_cfg = dataclasses.replace(gen_cfg, temperature=0.0, n_samples_per_prompt=1)
        self.sample_cfg = dataclasses.replace(gen_cfg, temperature=self.ecfg.temperature, n_samples_per_prompt=1)
        # one decoder for every evaluation of the job, sized for its larger pass (the sampled one)
        self.generator = Generator(model, vocab_size=cfg.model.vocab_size, state=state,
                                   rows=len(prompts) * max(1, self.ecfg.num_samples),
                                   slots=max((len(p.ids) for p in prompts), default=0) + gen_cfg.max_new_tokens - 1)
        # a multi-turn job (env.name) is evaluated over turns, with its environment (rollout/multiturn.py)
        self.multiturn = build_multiturn(cfg, state, self.generator, tokenizer, gen_cfg)

    def due(self, step: int) -> bool:
        """After RL step ``step`` (1-based): every eval.interval steps and after the last."""
        every = self.ecfg.interval
        return every > 0 and (step % every == 0 or step == self.cfg.train.num_steps)

    def _answer(self, prompts, gen_cfg, seed: int, where: str,
                should_stop: Optional[Callable[[], bool]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct [N] bool, response lengths [N]) of one response per prompt; Cancelled ("in its greedy pass, ...":
        every rank) when ``should_stop`` says so on any rank."""
        if self.multiturn is not None:
            return self._talk(prompts, gen_cfg, seed, where, should_stop)
        with explain_oom("generation", self.cfg, self.state, f"evaluation: {len(prompts)} rows"):
            out = self.generator.generate([p.ids for p in prompts], gen_cfg, seed=seed,
                                          row_keys=list(range(len(prompts))), should_stop=should_stop)
        if should_stop is not None:  # (without it nothing can cut the evaluation short: no vote)
            raise_together(out.abandoned or should_stop(), self.state.device,
                           f"in its {where}" + (", decoding cut short" if out.abandoned else ""),
                           what="stop vote after an evaluation generation")
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        try:
            rewards = compute_rewards(self.reward_fn, [p.text for p in prompts], texts, [p.answer for p in prompts],
                                      device=self.state.device, should_stop=should_stop)
        except Cancelled:
            rewards = None
        if should_stop is not None:
            raise_together(rewards is None, self.state.device, f"in its {where}, while scoring",
                           what="stop vote after evaluation scoring")
        return rewards >= 1.0, out.response_lengths

    def _talk(self, prompts, gen_cfg, seed: int, where: str, should_stop) -> tuple[torch.Tensor, torch.Tensor]:
        """``_answer`` of a multi-turn job: each held-out prompt talked to its end; correct when its reward (the
        environment's, or reward.name on the last response; no overlong penalty) is >= 1; the lengths count the
        sampled tokens. The turns and tool calls go to eval/turns_mean, eval/tool_calls_mean."""
        with explain_oom("generation", self.cfg, self.state, f"evaluation: {len(prompts)} rows over turns"):
            out = self.multiturn.run(prompts, list(range(len(prompts))), seed, should_stop=should_stop,
                                     gen_cfg=dataclasses.replace(gen_cfg, n_samples_per_prompt=1))
        if should_stop is not None:
            raise_together(out.abandoned or should_stop(), self.state.device,
                           f"in its {where}" + (", cut short" if out.abandoned else ""),
                           what="stop vote after an evaluation generation")
        try:
            rewards = multiturn_rewards(out, prompts, self.reward_fn, self.cfg, self.state.device, penalty=False,
                                        should_stop=should_stop)
        except Cancelled:
            rewards = None
        if should_stop is not None:
            raise_together(rewards is None, self.state.device, f"in its {where}, while scoring",
                           what="stop vote after evaluation scoring")
        self.turn_metrics = {"eval/turns_mean": sum(t["num_turns"] for t in out.trajectories) / len(prompts),
                             "eval/tool_calls_mean": sum(len(t["tool_calls"]) for t in out.trajectories) / len(prompts)}
        return rewards >= 1.0, out.response_mask.sum(-1)

    def close(self) -> None:
        if self.multiturn is not None:
            self.multiturn.close()

    @torch.no_grad()
    def run(self, step: int, should_stop: Optional[Callable[[], bool]] = None) -> dict[str, float]:
        """eval/* metrics after RL step ``step``. ``should_stop``: this rank's stop flag (module doc)."""
        e, P = self.ecfg, len(self.prompts)
        # argmax: no noise drawn
        correct, lengths = self._answer(self.prompts, self.greedy_cfg, 0, "greedy pass", should_stop)
        out = {"eval/greedy_accuracy": int(correct.sum()) / P,
               "eval/response_length_mean": int(lengths.sum()) / P,
               "eval/num_prompts": float(P), **self.length_metrics}
        if self.multiturn is not None:
            out.update(self.turn_metrics)  # the greedy pass's
        if e.num_samples > 0:
            n = e.num_samples
            rows = [p for p in self.prompts for _ in range(n)]  # prompt-major: row i*n + j
            # (eval.seed, step) in one 64-bit key, like ColocatedSource.sampling_seed with its own base seed
            ok, _ = self._answer(rows, self.sample_cfg, (e.seed << 32) + step, "sampled pass", should_stop)
            c = ok.reshape(P, n).sum(dim=1).tolist()
            out[f"eval/pass@{e.k}"] = sum(pass_at_k(n, ci, e.k) for ci in c) / P
            out["eval/sample_accuracy"] = sum(c) / (P * n)
        return out

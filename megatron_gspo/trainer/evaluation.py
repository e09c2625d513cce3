"""Evaluation during training: greedy accuracy, pass@k and response length on held-out prompts.

Every ``eval.interval`` RL steps and after the last one, the policy answers the held-out prompts
(data.build_eval_prompts) twice: once greedily (``eval/greedy_accuracy``, ``eval/response_length_mean``)
and ``eval.num_samples`` times at ``eval.temperature`` (``eval/pass@k`` by the unbiased estimator,
``eval/sample_accuracy`` = pass@1). A response is correct when its reward (reward.name, without the
overlong penalty) is >= 1: the full score of exact_match and math.

Evaluation leaves training untouched: its sampling noise is keyed by ``eval.seed`` (the
counter-based sampler of sampling.py draws no torch RNG state), it runs no routing capture, and the
trainer reseeds every step anyway; tests/test_evaluation.py checks a run's training metrics are
bit-identical with evaluation on and off.

Sharded over data parallelism: each pass's rows (the greedy pass: one per held-out prompt; the sampled
pass: ``eval.num_samples`` per prompt, prompt-major) are split into contiguous shares, one per DP rank
(``shard``: sizes differ by at most one; the TP ranks of a DP rank take the same share), and each rank
generates and scores its share only, its rows keyed by their global index (the counter-based sampler's
row keys), so every sample's tokens are the one-rank run's. The per-row counts (correct, response length;
a multi-turn job's turns and tool calls) are summed over the DP group into the global rows, so the metrics
are exactly those of one rank. Ranks that step together (EP or expert-TP over DP: ParallelState's
lockstep group) generate together; a rank whose share is empty steps on generate's dummy rows.

One generator: the evaluation runs on the colocated rollout source's ``Generator`` (its lean decoder, KV
cache and, under ``generation.cuda_graphs``, captured steps), sized for the larger of both uses
(``Generator.reserve``), and a multi-turn job's evaluation talks through the rollout's own
``MultiTurnRollout`` (its environment worker pool; the sampling config is passed per call). With
``rollout.engine=vllm`` that generator is the vLLM engine (rollout/vllm_engine.py ``EngineGenerator``), given
the weights of the step's updates before the evaluation's first generation. An
asynchronous job's trainer generates no rollouts: its evaluator keeps a generator (and a multi-turn
rollout) of its own.

A stop signal cuts an evaluation short (``should_stop``, read in the decode loop and voted on after each
generation): it raises runtime.stop.Cancelled on every rank; the step it follows stands, only its
eval/* metrics are missing, and the trainer goes on to save and stop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from megatron_gspo.config.rules import eval_rows_per_rank
from megatron_gspo.generation.generator import Generator
from megatron_gspo.runtime import comm
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


def shard(num_rows: int, parts: int, part: int) -> range:
    """Rows [num_rows * part // parts, num_rows * (part + 1) // parts) of ``range(num_rows)``: ``parts``
    contiguous shares in order, whose sizes differ by at most one (some empty when num_rows < parts)."""
    return range(num_rows * part // parts, num_rows * (part + 1) // parts)


class Evaluator:
    """Runs the held-out evaluation on the training model.

    cfg: the JobConfig; prompts: the held-out data.Prompt list; gen_cfg: the generation section with
    stop / pad ids filled in (its max_new_tokens, top_k, top_p apply); length_policy: how many held-out
    records data.overlong_prompt_policy dropped and cut (data.HeldOutPrompts), reported with every
    evaluation like the training prompts' data/dropped_prompts. generator / multiturn: the rollout
    source's (module doc: one generator), None to build this evaluator's own."""

    def __init__(self, cfg, state, model, tokenizer, reward_fn, gen_cfg, prompts, length_policy=(0, 0), *,
                 generator: Optional[Generator] = None, multiturn=None) -> None:
        self.cfg, self.ecfg, self.state, self.model = cfg, cfg.eval, state, model
        self.tokenizer, self.reward_fn, self.prompts = tokenizer, reward_fn, prompts
        self.length_metrics = {"eval/dropped_prompts": float(length_policy[0]),
                               "eval/truncated_prompts": float(length_policy[1])}
        self.greedy_cfg = dataclasses.replace(gen_cfg, temperature=0.0, n_samples_per_prompt=1)
        self.sample_cfg = dataclasses.replace(gen_cfg, temperature=self.ecfg.temperature, n_samples_per_prompt=1)
        self.dp, self.dp_rank = (state.dp, state.dp_rank) if state.dp > 1 else (1, 0)
        rows = eval_rows_per_rank(len(prompts), self.ecfg.num_samples, self.dp)
        slots = max((len(p.ids) for p in prompts), default=0) + gen_cfg.max_new_tokens - 1
        if generator is None:
            generator = Generator(model, vocab_size=cfg.model.vocab_size, state=state, rows=rows, slots=slots)
        else:
            generator.reserve(rows, slots)
        self.generator = generator
        # a multi-turn job (env.name) is evaluated over turns, with its environment (rollout/multiturn.py)
        self.owns_multiturn = multiturn is None
        self.multiturn = build_multiturn(cfg, state, generator, tokenizer, gen_cfg) if multiturn is None else multiturn

    def due(self, step: int) -> bool:
        """After RL step ``step`` (1-based): every eval.interval steps and after the last."""
        every = self.ecfg.interval
        return every > 0 and (step % every == 0 or step == self.cfg.train.num_steps)

    def _pass(self, n: int, gen_cfg, seed: int, where: str, should_stop) -> torch.Tensor:
        """One pass over the held-out prompts, ``n`` rows per prompt (prompt-major: row i * n + j), this rank
        its share (``shard``): [C, P * n] long, every row's counts (``_answer``'s columns) summed over the DP
        group, the same on every rank."""
        num_rows = len(self.prompts) * n
        mine = shard(num_rows, self.dp, self.dp_rank)
        cols = self._answer([self.prompts[g // n] for g in mine], list(mine), gen_cfg, seed, where, should_stop)
        out = torch.zeros(len(cols), num_rows, dtype=torch.long, device=self.state.device)
        for c, col in enumerate(cols):
            out[c, mine.start:mine.stop] = col.to(device=out.device, dtype=torch.long)
        if self.dp == 1:
            return out
        return comm.all_reduce(out, "sum", self.state.dp_group, what="evaluation: every DP rank's rows' counts")

    def _answer(self, prompts, keys, gen_cfg, seed: int, where: str,
                should_stop: Optional[Callable[[], bool]]) -> list[torch.Tensor]:
        """[correct, response length] (each [N]) of one response per prompt (``keys``: their rows' noise keys,
        the global row indices), a multi-turn job's with [turns, tool calls]; Cancelled ("in its greedy pass,
        ...": every rank) when ``should_stop`` says so on any rank."""
        if self.multiturn is not None:
            return self._talk(prompts, keys, gen_cfg, seed, where, should_stop)
        with explain_oom("generation", self.cfg, self.state, f"evaluation: {len(prompts)} rows"):
            out = self.generator.generate([p.ids for p in prompts], gen_cfg, seed=seed, row_keys=keys,
                                          should_stop=should_stop)
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
        return [rewards >= 1.0, out.response_lengths]

    def _talk(self, prompts, keys, gen_cfg, seed: int, where: str, should_stop) -> list[torch.Tensor]:
        """``_answer`` of a multi-turn job: each held-out prompt talked to its end; correct when its reward (the
        environment's, or reward.name on the last response; no overlong penalty) is >= 1; the lengths count the
        sampled tokens; then each row's turns and tool calls (eval/turns_mean, eval/tool_calls_mean)."""
        with explain_oom("generation", self.cfg, self.state, f"evaluation: {len(prompts)} rows over turns"):
            out = self.multiturn.run(prompts, keys, seed, should_stop=should_stop,
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
        turns = torch.tensor([t["num_turns"] for t in out.trajectories], dtype=torch.long)
        calls = torch.tensor([len(t["tool_calls"]) for t in out.trajectories], dtype=torch.long)
        return [rewards >= 1.0, out.response_mask.sum(-1), turns, calls]

    def close(self) -> None:
        if self.multiturn is not None and self.owns_multiturn:  # (the rollout source closes its own)
            self.multiturn.close()

    @torch.no_grad()
    def run(self, step: int, should_stop: Optional[Callable[[], bool]] = None) -> dict[str, float]:
        """eval/* metrics after RL step ``step``. ``should_stop``: this rank's stop flag (module doc). Collective
        over every rank (the stop votes, the counts' sum over the DP group)."""
        e, P = self.ecfg, len(self.prompts)
        greedy = self._pass(1, self.greedy_cfg, 0, "greedy pass", should_stop)  # argmax: no noise drawn
        out = {"eval/greedy_accuracy": int(greedy[0].sum()) / P,
               "eval/response_length_mean": int(greedy[1].sum()) / P,
               "eval/num_prompts": float(P), **self.length_metrics}
        if self.multiturn is not None:  # the greedy pass's
            out.update({"eval/turns_mean": int(greedy[2].sum()) / P, "eval/tool_calls_mean": int(greedy[3].sum()) / P})
        if e.num_samples > 0:
            n = e.num_samples
            # (eval.seed, step) in one 64-bit key, like ColocatedSource.sampling_seed with its own base seed
            sampled = self._pass(n, self.sample_cfg, (e.seed << 32) + step, "sampled pass", should_stop)
            c = sampled[0].reshape(P, n).sum(dim=1).tolist()
            out[f"eval/pass@{e.k}"] = sum(pass_at_k(n, ci, e.k) for ci in c) / P
            out["eval/sample_accuracy"] = sum(c) / (P * n)
        return out

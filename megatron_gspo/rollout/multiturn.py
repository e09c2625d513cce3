"""Multi-turn rollouts: the policy talks with an environment (tools, or a class) over turns, token in, token out.

A row's token stream is built from ids only and never rendered again (env/chat.py)::

    prompt ids | sampled turn 1 | observation 1 | sampled turn 2 | ... | sampled turn n
    loss mask   0...0        | 1...1          | 0...0         | 1...1          |     | 1...1

Sampled tokens keep the rollout's log-probs (0 elsewhere); the loss mask is 1 on them only, so the
losses (which read the mask for their token counts and GSPO's length) train on what the policy sampled,
over the whole trajectory. A row ends when the environment says ``done``, after ``env.max_turns``
turns, when an observation would not fit ``env.max_response_tokens``, or when a turn reaches its token
cap without a stop token (then it is *truncated*: ``stopped`` False, as a single-turn response cut at
generation.max_new_tokens; overlong filtering masks it).

Turn-level batching over the job's Generator: each turn is one ``generate`` call over the rows still
talking, each row's context its whole stream so far; rows that finished leave the batch. The KV cache is
kept across turns (generation/generator.py, "KV kept across turns"): every turn keeps its KV, and the next
one prefills only each row's new tokens (the last sampled token, never fed, and the observation) onto its
row's history, so a conversation's tokens are run through the model once (perf/prefill_tokens). On
megatron's decode path (generation.decode_impl=megatron, or auto where the lean decoder does not run) nothing
is kept and each turn prefills every row's whole stream again. Between turns every row's environment step runs at once in
the worker pool (env/pool.py), so a turn waits for its slowest tool call, not for their sum. Every rank
runs the same number of turns (one all-reduce per turn: rows still talking, the turn's token cap, a stop
request); where data-parallel ranks step together (``ParallelState.lockstep_over_dp``: EP or expert-TP) a rank
with no row left still calls generate, which steps with the others on its own dummy rows.
Under tensor parallelism the environments run on the first rank of the TP group, which broadcasts what
they said (a tool's timeout must not differ between ranks that sample the same rows).

Sampling noise: turn t of a row draws with the key ``row key + t * KEY_STRIDE``; turn 0 is exactly the
single-turn rollout's draw. Routes (R3, or the routing reference): each token keeps the routes of the
forward that processed it first, and only the positions new to a turn are taken from it, so every token of
the row has one route, never re-sent, paired with its own token. With the KV kept those are the routes its
successors were sampled under (its keys and values are that forward's), so R3 replays what sampling used;
where each turn prefills again (megatron's path) the later turns attend to a recomputed history, whose
routes can differ from the recorded ones by rounding.

A stop signal: generation stops within its lockstep group (generate's ``should_stop``), a tool call or an
environment's reset at once (the pool kills its workers); every rank then agrees at the next turn's vote
(the first turn's, for a reset) and the output comes
back ``abandoned`` (the rollout source raises runtime.stop.Cancelled on every rank).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_gspo.data.rewards.batch import FP32_MAX
from megatron_gspo.errors import DataError, EnvError, TokenizerError
from megatron_gspo.generation.generator import GenerationOutput, KeptRows
from megatron_gspo.runtime import comm
from megatron_gspo.runtime.stop import Cancelled

KEY_STRIDE = 1 << 40  # row keys of turn t: key + t * KEY_STRIDE (global row keys stay far below it)

log = logging.getLogger(__name__)


def generate_turn(generator, contexts: list, kept: list, keys: list[int], turn: int, cfg, seed: int, **kw):
    """Turn ``turn``'s generate call over rows (module doc): ``contexts`` their whole streams so far, ``kept`` each
    row's KeptRows from the turn before (the generator's ``kept``, one row each), ``keys`` their noise keys (this
    turn draws with key + turn * KEY_STRIDE). Where every row has its KV kept, only the new tokens are prefilled
    (none on a rank without rows); the call keeps its KV for the next turn. kw: generate's other keywords."""
    resume = KeptRows.cat(kept) if kept and all(k is not None for k in kept) else None
    return generator.generate(contexts, cfg, seed=seed, row_keys=[k + turn * KEY_STRIDE for k in keys], keep_kv=True,
                              resume=resume, **kw)


@dataclass
class Trajectory:
    """One row's conversation as it is built (module doc): the stream and its loss mask and log-probs, the
    spans of its turns, its tool calls, the environment's rewards and routes (per layer, one per token but
    the last: [L, n - 1, k], or None)."""

    tokens: list
    prompt_length: int
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    turns: list = field(default_factory=list)
    tool_calls: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    routes: Optional[torch.Tensor] = None
    kv: Optional[KeptRows] = None  # where the generator keeps this row's KV (the next turn's resume), or None
    ended: bool = False
    stopped: bool = True
    num_turns: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    max_turns_reached: bool = False
    env_error: Optional[str] = None
    final_text: str = ""
    prompt_id: object = None  # the data prompt's id: what the log names a row by

    def __post_init__(self) -> None:
        self.mask = [0] * len(self.tokens)
        self.logprobs = [0.0] * len(self.tokens)

    @property
    def used(self) -> int:
        """Tokens after the prompt."""
        return len(self.tokens) - self.prompt_length

    def append(self, ids: list, sampled: bool, logprobs=None) -> tuple[int, int]:
        start = len(self.tokens)
        self.tokens += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        return start, len(self.tokens)

    def summary(self) -> dict:
        """What the record keeps of the conversation (JSON): turns, tool calls, counts, the environment's reward."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "num_turns": self.num_turns,
                "tool_errors": self.tool_errors, "observation_tokens": self.observation_tokens,
                "max_turns_reached": self.max_turns_reached, "env_error": self.env_error,
                "env_reward": sum(self.rewards) if self.rewards else None, "final_text": self.final_text}


@dataclass
class MultiTurnOutput(GenerationOutput):
    """A GenerationOutput of multi-turn rows: ``response_mask`` is the loss mask (sampled tokens), the
    response is everything after the prompt; ``trajectories``: Trajectory.summary() per row; ``routes``: the
    rows' routing.RolloutRoutes (or None); ``stats``: rollout/* wall times of the turns' parts."""

    trajectories: list = field(default_factory=list)
    routes: object = None
    stats: dict = field(default_factory=dict)

    @property
    def num_generated_tokens(self) -> int:
        return int(self.response_mask.sum().item())


class MultiTurnRollout:
    """Runs the turns of a batch of rows (module doc). cfg: the JobConfig; generator: the job's Generator;
    runner: env/protocol.py's ToolRunner or ClassRunner (None on the TP ranks that do not run environments);
    fmt: env/chat.py's ChatFormat; gen_cfg: the generation section, one sample per row; budget: tokens after
    the prompt per row (config.rules.env_response_budget)."""

    def __init__(self, cfg, state, generator, tokenizer, runner, fmt, gen_cfg, budget: int) -> None:
        self.cfg, self.env, self.state, self.generator = cfg, cfg.env, state, generator
        self.tokenizer, self.runner, self.fmt, self.gen_cfg, self.budget = tokenizer, runner, fmt, gen_cfg, budget
        self.tp_group = state.tp_group if state is not None and state.tp > 1 else None
        self.tp_src = comm.first_rank(self.tp_group)
        self.runs_env = self.tp_group is None or state.tp_rank == 0
        self.lockstep = state is not None and state.lockstep_over_dp  # ranks with their own rows step together
        self.device = state.device if state is not None else torch.device("cpu")
        self.gen_kw: Optional[dict] = None  # run()'s
        self.error_kinds: set = set()  # the environment errors the log said already (the first of each kind)

    def close(self) -> None:
        """End the worker processes."""
        if self.runner is not None:
            self.runner.pool.close()

    # -- the environment, on one rank of a TP group ---------------------------------------------------
    def _on_env_rank(self, fn: Callable[[], object]):
        """``fn()`` on the rank that runs the environments, its JSON result broadcast over the TP group."""
        if self.tp_group is None:
            return fn()
        payload = json.dumps(fn() if self.runs_env else None).encode()
        n = comm.broadcast(torch.tensor([len(payload)], dtype=torch.long, device=self.device), self.tp_src,
                           self.tp_group, what="multi-turn: the environment's reply size")
        buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=self.device)
        if self.runs_env:
            buf.copy_(torch.tensor(list(payload), dtype=torch.uint8))
        buf = comm.broadcast(buf, self.tp_src, self.tp_group, what="multi-turn: the environment's reply")
        return json.loads(bytes(buf.cpu().tolist()).decode())

    def _reset(self, prompts: list, should_stop) -> Optional[list[str]]:
        """Every row's first message; None when a stop signal cut the environments' reset short."""
        examples = [{"id": p.id, "prompt": p.raw if p.raw is not None else p.text, "answer": p.answer} for p in prompts]

        def run():
            try:
                return self.runner.reset(examples, should_stop)
            except Cancelled:  # the pool killed its workers: this rank's part of the first turn's vote
                return None
        return self._on_env_rank(run)

    def _step(self, texts: list[str], rows: list[int], should_stop) -> Optional[list[dict]]:
        """Every listed row's environment step, as StepResult dicts; None when a stop signal cut it short."""
        def run():
            try:
                return [dataclasses.asdict(r) for r in self.runner.step(texts, rows, should_stop)]
            except Cancelled:  # the pool killed its workers: this rank's part of the turn's vote
                return None
        return self._on_env_rank(run)

    # -- turns ---------------------------------------------------------------------------------------
    def _vote(self, n_live: int, cap: int, stop: bool) -> tuple[int, int, bool]:
        """(rows still talking on the rank that has most, the largest turn cap, a stop request anywhere)."""
        t = torch.tensor([n_live, cap, int(stop)], dtype=torch.long, device=self.device)
        n, c, s = comm.all_reduce(t, "max", None, what="multi-turn: rows still talking, turn cap, stop").tolist()
        return n, c, bool(s)

    def _generate(self, rows: list[Trajectory], keys: list[int], turn: int, cap: int, seed: int, routing,
                  should_stop):
        """One turn's generate call over ``rows`` (none: this rank steps on generate's dummy rows); (output, routes)."""
        cfg = dataclasses.replace(self.gen_cfg, max_new_tokens=cap, min_new_tokens=min(self.gen_cfg.min_new_tokens, cap))
        on_forward = routing.on_generation_forward if routing is not None else None
        with (routing.generating() if routing is not None else _nothing()):
            out = generate_turn(self.generator, [r.tokens for r in rows], [r.kv for r in rows], keys, turn, cfg, seed,
                                on_forward=on_forward, **(self.gen_kw or {"should_stop": should_stop}))
        # (an abandoned turn's routes are never taken; on vLLM it has no rows, so none were recorded)
        routes = (routing.rollout_routes(out) if routing is not None and on_forward is not None and rows
                  and not out.abandoned else None)
        return out, routes

    def _take(self, row: Trajectory, out, j: int, cap: int, routes) -> list:
        """Append generated row ``j`` of ``out`` (cut to the row's ``cap``) to ``row``; returns its sampled ids."""
        p, n = int(out.prompt_lengths[j]), int(out.response_lengths[j])
        keep = min(n, cap)
        ids = out.tokens[j, p:p + keep].tolist()
        start, end = row.append(ids, True, out.logprobs[j, p:p + keep].tolist())
        if routes is not None:  # the positions new to this turn: the last token before it, its context, its response
            have = 0 if row.routes is None else row.routes.shape[1]
            new = routes.routes[:, j, have:end - 1].long()
            row.routes = new if row.routes is None else torch.cat([row.routes, new], 1)
        row.kv = out.kept.select([j]) if out.kept is not None else None
        row.num_turns += 1
        row.final_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        row.turns.append({"role": "assistant", "start": start, "end": end, "text": row.final_text})
        if keep < n or not bool(out.stopped[j]):  # the turn's token cap without a stop token: truncated
            row.ended, row.stopped = True, False
        return ids

    def _observe(self, row: Trajectory, res: dict, last_id: int) -> None:
        """Apply one environment step to ``row``: tool calls, reward, the end, or the observation appended once."""
        # a result as the policy reads it (cut to env.max_observation_tokens): what the record and the dump keep
        row.tool_calls += [{"turn": row.num_turns, **c, **({"result": self._cut(c["result"])} if "result" in c else {})}
                           for c in res["tool_calls"]]
        row.tool_errors += res["tool_errors"]
        if res["reward"] is not None:
            row.rewards.append(res["reward"])
            if abs(sum(row.rewards)) > FP32_MAX:  # each one within float32's range, their sum not
                res = {**res, "error": f"{self.env.name}: the rewards of row {row.prompt_id!r} sum to "
                                      f"{sum(row.rewards):g}, beyond float32's range", "error_kind": "reward sum"}
                row.rewards.pop()
        if res["error"] is not None:
            self._env_error(row, res["error"], res.get("error_kind") or "error")
        elif res["done"]:
            row.ended = True
        elif row.num_turns >= self.env.max_turns:
            row.ended, row.max_turns_reached = True, True
        else:
            try:
                messages = [{**m, "content": self._cut(m["content"])} for m in (res["observation"] or [])]
                ids = self.fmt.observation_ids(messages, last_id)
            except TokenizerError as e:  # a character the tokenizer has no token for: the row's end, not the job's
                self._env_error(row, f"{self.env.name}: the observation after turn {row.num_turns} of row "
                                     f"{row.prompt_id!r} cannot be tokenized: {e}", "TokenizerError")
                return
            if row.used + len(ids) + 1 > self.budget:  # no room left for another turn
                row.ended = True
                return
            start, end = row.append(ids, False)
            row.observation_tokens += len(ids)
            role = messages[0]["role"] if messages else "user"
            row.turns.append({"role": role, "start": start, "end": end, "text": "\n".join(m["content"] for m in messages)})

    def _env_error(self, row: Trajectory, error: str, kind: str) -> None:
        """End ``row`` on the environment's ``error``; the first error of each ``kind`` is said in the log (the
        rest are counted: rollout/env_error_frac, and the dump keeps each row's)."""
        row.ended, row.env_error = True, error
        if kind not in self.error_kinds and self.runs_env:
            self.error_kinds.add(kind)
            log.warning("environment error on row %r (the first %s; later ones are counted in rollout/env_error_frac, "
                        "the job stops past env.max_error_frac=%g of a step's rows): %s", row.prompt_id, kind,
                        self.env.max_error_frac, error)

    def _cut(self, text: str) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        limit = self.env.max_observation_tokens
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit])

    def _start(self, prompts: list, should_stop) -> tuple[list[Trajectory], bool]:
        """(every row's prompt: the environment's first message rendered, False), or (placeholder rows, True) when a
        stop signal cut the reset short: the first turn's vote then takes every rank out of the step together. One
        over data.max_prompt_length is handled by data.overlong_prompt_policy, as the data's prompts are: "error"
        stops the job, "truncate_left" keeps its last tokens, "drop" (the default) ends the row before its first
        turn, no token sampled (the loss mask all 0: nothing of it is trained), on an environment error that says
        so (counted: rollout/env_error_frac)."""
        messages = self._reset(prompts, should_stop)
        if messages is None:  # never trained: the caller leaves the step on every rank
            return [Trajectory([self.gen_cfg.pad_id], 1, prompt_id=p.id) for p in prompts], True
        tools = self.runner.schemas() if self.runner is not None else None
        limit, policy = self.cfg.data.max_prompt_length, self.cfg.data.overlong_prompt_policy
        rows = []
        for p, message in zip(prompts, messages):
            ids = self.fmt.prompt_ids(message, tools)
            if len(ids) <= limit:
                rows.append(Trajectory(ids, len(ids), prompt_id=p.id))
                continue
            said = (f"prompt {p.id}: the environment's first message {message[:60]!r} renders to {len(ids)} tokens"
                    f"{' with the tools in the system prompt' if tools else ''} > data.max_prompt_length={limit}")
            if policy == "error":
                raise DataError(f"{said}; raise data.max_prompt_length or set data.overlong_prompt_policy to 'drop' "
                                "or 'truncate_left'")
            if policy == "truncate_left":
                rows.append(Trajectory(ids[-limit:], limit, prompt_id=p.id))
                continue
            row = Trajectory(ids[:limit], limit, prompt_id=p.id)
            self._env_error(row, f"{said}: dropped (data.overlong_prompt_policy=drop)", "over-long first message")
            rows.append(row)
        if rows and all(r.env_error is not None for r in rows):
            raise DataError(f"every prompt of the batch is over-long, e.g. {rows[0].env_error}; raise "
                            "data.max_prompt_length")
        return rows, False

    def run(self, prompts: list, keys: list[int], seed: int, routing=None,
            should_stop: Optional[Callable[[], bool]] = None, gen_cfg=None, gen_kw: Optional[dict] = None) -> MultiTurnOutput:
        """The rows of ``prompts`` (data.Prompt, one row each; ``keys``: their noise keys) talked to the end;
        ``gen_cfg``: another sampling config for this call (the evaluator's greedy pass), one sample per row;
        ``gen_kw``: keywords of every turn's generate in place of ``should_stop`` (an asynchronous rollout rank's
        ``poll`` / ``on_update``: weight pushes between decode steps; rollout/worker.py)."""
        saved, self.gen_cfg, self.gen_kw = self.gen_cfg, gen_cfg or self.gen_cfg, gen_kw
        try:
            return self._run(prompts, keys, seed, routing, should_stop)
        finally:
            self.gen_cfg, self.gen_kw = saved, None
            self.generator.release_kv()  # the turns' KV (kept from one turn to the next)

    # long: the turn loop in one place, each step a call (generate, take, observe, vote)
    def _run(self, prompts: list, keys: list[int], seed: int, routing, should_stop) -> MultiTurnOutput:
        t0, times = time.perf_counter(), {"prefill_s": 0.0, "num_forwards": 0, "decode_row_steps": 0,
                                          "decode_live_row_steps": 0, "prefill_tokens": 0}
        env_s = 0.0
        rows, stop = self._start(prompts, should_stop)
        turn = 0
        while True:
            live = [i for i, r in enumerate(rows) if not r.ended]
            caps = [min(self.gen_cfg.max_new_tokens, self.budget - rows[i].used) for i in live]
            n_live, cap, stop = self._vote(len(live), max(caps, default=0), stop or (should_stop is not None and should_stop()))
            if stop or n_live == 0:
                break
            if live or self.lockstep:
                out, routes = self._generate([rows[i] for i in live], [keys[i] for i in live], turn, cap, seed, routing,
                                             should_stop)
                times = {k: v + getattr(out, k) for k, v in times.items()}
                if out.abandoned:
                    stop = True
                    continue
                sampled = {i: self._take(rows[i], out, j, c, routes) for j, (i, c) in enumerate(zip(live, caps))}
                talking = [i for i in live if not rows[i].ended]
                t_env = time.perf_counter()
                results = self._step([rows[i].final_text for i in talking], talking, should_stop) if talking else []
                env_s += time.perf_counter() - t_env
                if results is None:
                    stop = True
                    continue
                for i, res in zip(talking, results):
                    self._observe(rows[i], res, sampled[i][-1])
            turn += 1
        if self.runner is not None and self.runs_env and not stop:
            self.runner.end(list(range(len(rows))))
        return self._output(rows, t0, times, env_s, stop, routing)

    def _output(self, rows: list[Trajectory], t0: float, times: dict, env_s: float, abandoned: bool,
                routing) -> MultiTurnOutput:
        """The rows on the right-padded [B, T] grid (generation's GenerationOutput layout)."""
        dev, pad = self.device, self.gen_cfg.pad_id
        B, T = len(rows), max((len(r.tokens) for r in rows), default=0)  # none: a rank whose evaluation share is empty
        tokens = torch.full((B, T), pad, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        lp = torch.zeros(B, T, dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            tokens[i, :n] = torch.tensor(r.tokens)
            mask[i, :n] = torch.tensor(r.mask, dtype=torch.bool)
            lp[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
        plen = torch.tensor([r.prompt_length for r in rows], dtype=torch.long)
        total = torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)
        routes = None
        if routing is not None and routing.on_generation_forward is not None and not abandoned:
            from megatron_gspo.routing.rollout_routes import RolloutRoutes

            L, _, k = next(r.routes for r in rows if r.routes is not None).shape
            # a row dropped before its first turn has no route: the training forward's filler routes (its mask is 0)
            routes = RolloutRoutes.from_rows([r.routes if r.routes is not None else torch.zeros(L, 0, k, dtype=torch.long)
                                              for r in rows], L, k, routing.recorder.num_experts)
        return MultiTurnOutput(
            tokens=tokens.to(dev), prompt_lengths=plen.to(dev), response_lengths=(total - plen).to(dev),
            response_mask=mask.to(dev), logprobs=lp.to(dev),
            stopped=torch.tensor([r.stopped for r in rows], dtype=torch.bool, device=dev),
            prompt_index=torch.arange(B, device=dev), elapsed_s=time.perf_counter() - t0, **times,
            temperature=self.gen_cfg.temperature, abandoned=abandoned,
            trajectories=[r.summary() for r in rows], routes=routes, stats={"rollout/env_s": env_s})


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def build_multiturn(cfg, state, generator, tokenizer, gen_cfg) -> Optional[MultiTurnRollout]:
    """The job's multi-turn rollout (env.name set), or None. The tools' schemas and the environment class are
    loaded on every rank (a bad name fails at start-up, everywhere); the worker pool starts its processes on
    the first call, on the ranks that run environments."""
    if not cfg.env.enabled:
        return None
    from megatron_gspo.config.rules import env_response_budget
    from megatron_gspo.env.chat import build_format
    from megatron_gspo.env.protocol import build_runner

    fmt = build_format(tokenizer, cfg.data, cfg.env.tool_format)
    runner = build_runner(cfg.env, fmt.tool_format)
    note = tools_prompt_note(fmt, runner.schemas(), cfg.data.max_prompt_length)
    if note is not None and (state is None or state.is_main):
        log.log(note[0], "%s", note[1])
    row_cfg = dataclasses.replace(gen_cfg, n_samples_per_prompt=1)
    return MultiTurnRollout(cfg, state, generator, tokenizer, runner, fmt, row_cfg, env_response_budget(cfg))


def check_env_error_frac(trajectories: list, env_cfg, state, step: int) -> None:
    """Stop the job (EnvError) when more than env.max_error_frac of step ``step``'s rows (over the data-parallel
    ranks: every rank decides alike) ended on an environment error: the environment is broken, not a row. Called
    after the step's rollout is dumped (train.dump_rollouts keeps the rows and their errors), before its update."""
    if not trajectories:
        return
    errors = [t for t in trajectories if t["env_error"] is not None]
    dev = state.device if state is not None else torch.device("cpu")
    counts = torch.tensor([len(errors), len(trajectories)], dtype=torch.float64, device=dev)
    if state is not None and state.dp > 1:
        comm.all_reduce(counts, "sum", state.dp_group, what="multi-turn: rows that ended on an environment error")
    n_errors, n_rows = (int(x) for x in counts.tolist())
    if n_errors > env_cfg.max_error_frac * n_rows:
        first = f"; the first on this rank: {errors[0]['env_error']}" if errors else ""
        raise EnvError(f"{n_errors} of step {step}'s {n_rows} rows ended on an environment error, more than "
                       f"env.max_error_frac={env_cfg.max_error_frac:g} of them{first}")


def tools_prompt_note(fmt, tools: list, max_prompt_length: int) -> Optional[tuple[int, str]]:
    """(log level, what to say at start-up) of the tokens the tools' schemas add to every prompt (a chat template
    lists them in its system prompt: Qwen3's makes a 4-character message some 980 tokens), or None when the format
    shows none (the plain one)."""
    if not tools:
        return None
    shown, bare = len(fmt.prompt_ids("?", tools)), len(fmt.prompt_ids("?", None))
    if shown == bare:
        return None
    left = max_prompt_length - (shown - 1)
    said = (f"env.tools: the chat template shows the tools' schemas in every prompt: {shown - bare} tokens (a "
            f"1-character message renders to {shown}); data.max_prompt_length={max_prompt_length} leaves {max(left, 0)} "
            "tokens for the message itself")
    if left <= 0:
        return logging.WARNING, said + ": every prompt is over it; raise data.max_prompt_length"
    return logging.INFO, said


def multiturn_rewards(out: MultiTurnOutput, prompts: list, reward_fn, cfg, device, penalty: bool = True,
                      should_stop: Optional[Callable[[], bool]] = None) -> torch.Tensor:
    """[B] fp32: each row's environment reward (the sum of what its steps returned), or, for a row that got
    none, ``reward_fn`` on its last response; plus DAPO's overlong penalty over the row's budget
    (env.max_response_tokens as L_max: a multi-turn row's length limit) unless ``penalty`` is False (evaluation).
    Cancelled when ``should_stop()`` cut the scoring short."""
    from megatron_gspo.algorithms.overlong import overlong_penalty
    from megatron_gspo.config.rules import env_response_budget
    from megatron_gspo.data.rewards import compute_rewards

    trajs = out.trajectories
    rewards = [t["env_reward"] for t in trajs]
    need = [i for i, r in enumerate(rewards) if r is None]
    if need:
        scored = compute_rewards(reward_fn, [prompts[i].text for i in need], [trajs[i]["final_text"] for i in need],
                                 [prompts[i].answer for i in need], device=device,
                                 should_stop=should_stop).tolist()
        for i, r in zip(need, scored):
            rewards[i] = r
    result = torch.tensor(rewards, dtype=torch.float32, device=device)
    r = cfg.reward
    if penalty and r.overlong_buffer_len > 0:
        result = result + overlong_penalty(out.response_lengths.to(device), env_response_budget(cfg),
                                           r.overlong_buffer_len, r.overlong_penalty_factor)
    return result

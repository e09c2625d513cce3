"""``train.dump_rollouts=true``: every step's rollout rows in ``{output_dir}/rollouts/step_XXXXXX.jsonl``.

One JSON object per row (rank 0 writes the rows of every data-parallel rank, after the step's rollout)::

    {"step": 3, "sample_id": "arithmetic-1234-17#2",
     "token_ids": [...],                     the row: prompt, then every turn, sampled and observed
     "loss_mask": [0, 0, ..., 1, 1, ...],    same length: 1 on the tokens the policy sampled
     "turns": [{"role": "assistant" | "tool" | "user", "start": 7, "end": 38, "text": "..."}, ...],
     "tool_calls": [{"turn": 1, "name": ..., "arguments": {...}, "result": "..." | "error": "..."}],
     "reward": 1.0, "advantage": 0.93,
     "env_error": null}                      multi-turn rows: the environment's error that ended the row, or null

``turns`` are spans over ``token_ids`` (``token_ids[start:end]``); a single-turn job's row has one
assistant turn and no tool calls. The spans and the mask say exactly what the loss trained on.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.runtime.hooks import TrainerHook


def batch_rows(batch, step: int) -> list[dict]:
    """The dump's rows of a TrainBatch (rollout/prepare.py) of step ``step`` (1-based), in the batch's order."""
    tokens, mask = batch.tokens.cpu(), batch.mask.cpu()
    lengths = batch.seq_lengths.tolist()
    rows = []
    for i, n in enumerate(lengths):
        loss_mask = [0] + mask[i, :n - 1].long().tolist()
        traj = batch.trajectories[i] if batch.trajectories else None
        extra = {}
        if traj is not None:
            turns, calls = traj["turns"], traj["tool_calls"]
            extra = {"env_error": traj["env_error"]}  # why the row ended early, or None
        else:
            start = loss_mask.index(1) if 1 in loss_mask else n
            turns = [{"role": "assistant", "start": start, "end": n, "text": batch.response_texts[i]}]
            calls = []
        rows.append({"step": step, "sample_id": batch.sample_ids[i], "token_ids": tokens[i, :n].tolist(),
                     "loss_mask": loss_mask, "turns": turns, "tool_calls": calls,
                     "reward": float(batch.rewards[i]), "advantage": float(batch.advantages[i]), **extra})
    return rows


def _gather_text(text: str, state) -> list[str]:
    """Every data-parallel rank's ``text`` on the DP group's first rank, [] on the others (a collective over the
    DP group: each rank's rows, their conversations with them, go to the one rank that writes them)."""
    if state.dp == 1:
        return [text]
    raw = torch.tensor(list(text.encode()), dtype=torch.uint8, device=state.device)
    n = comm.max_int(raw.numel(), state.device, state.dp_group, what="rollout dump: the longest part")
    padded = torch.nn.functional.pad(raw, (0, n - raw.numel()))
    dst = comm.first_rank(state.dp_group)
    sizes = comm.gather_to(torch.tensor([raw.numel()], dtype=torch.long, device=state.device), dst, state.dp_group,
                           what="rollout dump: part sizes")
    parts = comm.gather_to(padded, dst, state.dp_group, what="rollout dump: the rows of every data-parallel rank")
    return [] if parts is None else [bytes(p[:int(s)].cpu().tolist()).decode() for p, s in zip(parts, sizes)]


class RolloutDump(TrainerHook):
    """Writes the step's rows after its rollout (module doc)."""

    def after_rollout(self, trainer, batch) -> None:
        step = trainer.step + 1
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in batch_rows(batch, step))
        parts = _gather_text(text, trainer.state)
        if trainer.state.is_main:
            folder = os.path.join(trainer.cfg.train.output_dir, "rollouts")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"step_{step:06d}.jsonl"), "w", encoding="utf-8") as f:
                f.write("".join(parts))

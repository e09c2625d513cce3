"""The MoE load-balancing loss per sequence (``model.moe_router_load_balancing_type=seq_aux_loss``).

Each sequence's Switch loss is computed over that sequence's own tokens, and the step's loss is

    coeff x sum over MoE layers, sum over the sequences i of the optimizer step (every DP rank)  L_i / R
    L_i = E x sum_e f_ie P_ie,   f_ie = c_ie / (k T_i),   P_ie = (sum over i's tokens of the score of e) / T_i

with c_ie the tokens of sequence i routed to expert e (top-k of the full router scores, as megatron's
aux loss counts them), T_i its valid (non-padding) input tokens and R the step's sequences. A sequence's
term depends on nothing but that sequence, and R on the step: the loss and its gradient do not depend on
which DP rank or which micro-batch a row was dealt to. megatron's statistics cannot give that: its
"aux_loss" counts expert loads over a micro-batch (over the TP group), "global_aux_loss" over the DP group
too, averaged over the micro-batches run so far, and its "seq_aux_loss" normalises every sequence of a
micro-batch by their *mean* length and weighs micro-batches by their tokens -- with rows of different
lengths, each depends on which rows share a micro-batch. (For rows of one length, no padding, L_i and
megatron's per-sequence term are the same number.)

The loss is attached as megatron attaches its own: in a forward hook on each router, to the router's
output probabilities through ``MoEAuxLossAutoScaler``, whose backward gives the loss the gradient scale
``set_aux_loss_scale`` set for the micro-batch (``coeff / R``: ``gpt.aux_loss_scales``). It so reaches the
router's weights and the hidden states under activation recompute too (the hook runs again in the
recomputed forward, where the gradient is taken). megatron's own aux loss is off for this type
(``build_transformer_config`` passes it ``none``).
"""

from __future__ import annotations

import torch


def sequence_switch_losses(scores: torch.Tensor, counts: torch.Tensor, num_tokens: torch.Tensor,
                           topk: int) -> torch.Tensor:
    """Each sequence's Switch load-balancing loss (or this rank's part of it).

    scores       [s, b, E] float: the full router scores (softmax over E) of the tokens this rank holds,
                 0 at padding; grad flows through these.
    counts       [b, E]: tokens of each whole sequence routed to each expert (no grad; summed over the
                 ranks that hold parts of the sequence).
    num_tokens   [b]: valid tokens of each whole sequence (same reduction).
    Returns [b]: E x sum_e (c_be / (k T_b)) (sum_s scores_sbe / T_b); 0 for a sequence without tokens.
    Where a sequence is split over ranks (sequence / context parallel) each rank's value is its tokens'
    part of the loss and the parts add up to the whole (the counts are the whole sequence's)."""
    E = scores.shape[-1]
    t = num_tokens.to(scores.dtype)
    prob_sums = scores.sum(0)  # [b, E]
    per_seq = (prob_sums * counts.to(scores.dtype)).sum(-1)  # [b]
    return torch.where(t > 0, per_seq * E / (topk * t.clamp(min=1) ** 2), torch.zeros_like(per_seq))


class SequenceAuxLoss:
    """Forward hooks that attach the per-sequence load-balancing loss to every MoE router of ``model``
    (see the module docstring). ``tp_cp_group``: the group over which a sequence's tokens are split
    (sequence parallel under TP, context parallel); its counts are summed over it. Active only in
    training forwards with gradients on; ``close()`` removes the hooks."""

    def __init__(self, model, tp_cp_group):
        from megatron.core.transformer.moe.router import Router

        self.group = tp_cp_group if tp_cp_group is not None and tp_cp_group.size() > 1 else None
        self._hooks = [r.register_forward_hook(self._hook, with_kwargs=True) for r in model.modules() if isinstance(r, Router)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook(self, router, args, kwargs, out):
        if not (router.training and torch.is_grad_enabled()):
            return None
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, compute_routing_scores_for_aux_loss

        from megatron_gspo.runtime import comm

        probs, routing_map = out
        x = args[0] if args else kwargs["input"]
        pad = args[1] if len(args) > 1 else kwargs.get("padding_mask")  # [s, b] True = padding (megatron's)
        cfg = router.config
        # the router's logits again (one [T, H] x [H, E] GEMM): its forward does not hand them out
        logits = router.gating(x)  # [s, b, E]
        s, b, E = logits.shape
        flat_pad = None if pad is None else pad.reshape(-1)
        rmap, scores = compute_routing_scores_for_aux_loss(
            logits.reshape(-1, E), cfg.moe_router_topk, router.score_function, fused=cfg.moe_router_fusion,
            padding_mask=flat_pad)
        scores, rmap = scores.reshape(s, b, E), rmap.reshape(s, b, E)
        with torch.no_grad():
            valid = torch.ones(s, b, dtype=torch.bool, device=logits.device) if pad is None else ~pad
            stats = torch.cat([rmap.sum(0).to(torch.float32), valid.sum(0, keepdim=True).T.to(torch.float32)], 1)
            if self.group is not None:  # [b, E + 1]: the whole sequence's counts
                comm.all_reduce(stats, "sum", self.group, what="seq_aux_loss: expert counts per sequence")
        losses = sequence_switch_losses(scores, stats[:, :E], stats[:, E], cfg.moe_router_topk)
        return MoEAuxLossAutoScaler.apply(probs, losses.sum()), routing_map

"""The MoE load-balancing loss of the default job (model.moe_router_load_balancing_type=seq_aux_loss):
one Switch loss per sequence, averaged over the optimizer step's sequences, so its gradient does not
depend on which micro-batch (or DP rank: tests/test_layouts.py) a row was dealt to.

In-process, one rank, the tiny MoE (2 layers, 4 experts, top-2): the aux loss's gradient alone (the
main loss multiplied by 0) of ragged rows, under several dealings into micro-batches."""

import pytest
import torch

from megatron_gspo.config import ParallelConfig, model_config_from_preset

VOCAB = 100
LENGTHS = [12, 5, 9, 12, 7, 3, 10, 6]  # ragged rows: the padding of a micro-batch depends on its rows


def test_sequence_loss_is_megatrons_switch_loss_of_each_sequence_alone():
    """Each sequence's value is megatron's switch_load_balancing_loss_func over that sequence's own valid
    tokens, whatever padding the grid around it has (hand-built scores and routes)."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    from megatron_gspo.model.load_balancing import sequence_switch_losses

    g = torch.Generator().manual_seed(0)
    s, b, E, k = 6, 3, 4, 2
    scores = torch.softmax(torch.randn(s, b, E, generator=g), -1)
    rmap = torch.zeros(s, b, E, dtype=torch.bool).scatter(-1, scores.topk(k, -1).indices, True)
    lengths = torch.tensor([6, 2, 4])
    valid = torch.arange(s)[:, None] < lengths[None, :]  # [s, b]
    scores, rmap = scores * valid[..., None], rmap & valid[..., None]
    got = sequence_switch_losses(scores, rmap.sum(0), valid.sum(0), k)
    for i in range(b):
        n = int(lengths[i])
        want = switch_load_balancing_loss_func(scores[:n, i], rmap[:n, i].sum(0).float(), n, k, E, 1.0)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=0)
    # a sequence without tokens contributes nothing (no 0 / 0)
    assert sequence_switch_losses(scores, rmap.sum(0), torch.tensor([6, 0, 4]), k)[1] == 0


def _rows():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=g)
    for i, n in enumerate(LENGTHS):
        tokens[i, n:] = 0
    return tokens, torch.tensor(LENGTHS)


def _aux_grads(model, st, cfg, dealing):
    """The aux loss's gradient of one optimizer step over ``dealing`` (micro-batches as row lists), each
    micro-batch cut to its own longest row, as the trainer does."""
    from megatron_gspo.model.gpt import aux_loss_scales, forward_logits, input_padding_mask, set_aux_loss_scale

    tokens, lengths = _rows()
    micros = []
    for rows in dealing:
        w = int(lengths[rows].max())
        micros.append((tokens[rows, :w].to(st.device), input_padding_mask(lengths[rows], w - 1).to(st.device)))
    scales = aux_loss_scales([m for _, m in micros], st, cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff)
    model.zero_grad(set_to_none=True)
    for (tok, pad), scale in zip(micros, scales):
        set_aux_loss_scale(scale, st.device)
        logits = forward_logits(model, tok[:, :-1], padding_mask=pad)
        (logits.float().sum() * 0).backward()  # the aux loss alone
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel_err(got, ref):
    num = sum(float(((got[k] - ref[k]).double() ** 2).sum()) for k in ref)
    den = sum(float((ref[k].double() ** 2).sum()) for k in ref)
    return (num / den) ** 0.5


DEALINGS = {
    "one micro-batch": [list(range(8))],
    "two in order": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "other rows together": [[5, 1, 7], [0, 2, 3, 4, 6]],
    "one row each": [[i] for i in range(8)],
}


@pytest.mark.parametrize("recompute", [False, True])
def test_default_aux_loss_gradient_does_not_depend_on_the_dealing(single_rank, recompute):
    """The default (seq_aux_loss): the same gradient for every dealing of the rows into micro-batches, also
    under full activation recompute (the hook runs again in the recomputed forward); megatron's
    micro-batch statistic (aux_loss) gives another gradient per dealing."""
    from megatron_gspo.model.gpt import build_model

    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, **extra)  # the default aux loss
    par = ParallelConfig(device="cpu", seed=5)
    st = single_rank(cfg, par)
    model = build_model(cfg, par, st)
    grads = {name: _aux_grads(model, st, cfg, d) for name, d in DEALINGS.items()}
    ref = grads["one micro-batch"]
    norm = sum(float((v.double() ** 2).sum()) for v in ref.values()) ** 0.5
    assert norm > 1e-6 and any("router" in n for n in ref)  # a real aux gradient, the routers' included
    for name, got in grads.items():
        assert _rel_err(got, ref) < 1e-5, (name, _rel_err(got, ref))
    assert cfg.moe_router_load_balancing_type == "seq_aux_loss" and cfg.moe_aux_loss_coeff == 1e-3

    if not recompute:  # the test sees the difference megatron's per-micro-batch statistic makes
        mcfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_router_load_balancing_type="aux_loss")
        mmodel = build_model(mcfg, par, st)
        mref = _aux_grads(mmodel, st, mcfg, DEALINGS["one micro-batch"])
        err = _rel_err(_aux_grads(mmodel, st, mcfg, DEALINGS["other rows together"]), mref)
        print(f"aux_loss (megatron), other dealing: relative difference {err:.3g}; seq_aux_loss: "
              + ", ".join(f"{k} {_rel_err(v, ref):.2g}" for k, v in grads.items()) + f"; gradient norm {norm:.3g}")
        assert err > 1e-2


def test_one_full_row_is_megatrons_aux_loss_with_the_coefficient(single_rank):
    """One unpadded row is one sequence and one micro-batch: the per-sequence loss is megatron's aux loss
    there, with the same weight (moe_aux_loss_coeff), so the gradients agree; a coefficient of 0 gives none."""
    from megatron_gspo.model.gpt import build_model

    par = ParallelConfig(device="cpu", seed=5)
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB)
    st = single_rank(cfg, par)
    full = [[0]]  # LENGTHS[0] is the longest: no padding
    ours = _aux_grads(build_model(cfg, par, st), st, cfg, full)
    mcfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_router_load_balancing_type="aux_loss")
    theirs = _aux_grads(build_model(mcfg, par, st), st, mcfg, full)
    assert ours.keys() == theirs.keys()
    assert _rel_err(ours, theirs) < 1e-5
    off = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0)
    assert all(float(v.abs().max()) == 0 for v in _aux_grads(build_model(off, par, st), st, off, full).values())

"""SAPO, CISPO, GMPO, LUSPO and VESPO, and GRPO under the off-policy sequence mask (OPSM), agree with the peers'
implementations on the same batches.

TRL 1.16 (the ``test`` extra installs it, so this runs wherever the suite runs): ``GRPOTrainer`` with
``loss_type`` sapo / cispo / luspo / vespo (VESPO also with token IS ratios, which TRL folds into its sequence
weight), ``loss_type="grpo"`` with ``off_policy_mask_threshold`` (against our grpo, loss_agg_mode
seq-mean-token-mean, under rollout_correction mode opsm) and ``trl.experimental.gmpo.GMPOTrainer``, built for real and fed the
batch (tests/peer_losses.py). verl 0.9.1's ``core_algos`` (sapo, cispo, geo_mean; it has no LUSPO) runs
only on request, ``GSPO_PEER_VERL=1``, where verl is installed: it is not in the ``test`` extra (it pins
transformers < 5.11 and brings ray; docs/algorithms.md gives the measured cost and the result).

Same inputs in float64 on both sides; values and gradients w.r.t. the log-probs agree to float
rounding. The peers' own conventions are mapped, not imitated: TRL's CISPO ``epsilon_high`` is the
absolute weight cap (1 + our clip_ratio_high), TRL's SAPO temperatures are float32 scalars (so ~1e-8
relative), verl adds 1e-8 to its length denominators. Batches have no empty responses: the peers
count an empty row as a sequence (TRL and verl's geo_mean divide by B), this project ignores it
(tests/test_loss_references.py covers empty rows).
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_gspo.algorithms.losses import cispo_loss, gmpo_loss, grpo_loss, luspo_loss, sapo_loss, vespo_loss
from megatron_gspo.algorithms.rollout_correction import correction_weights

pytestmark = pytest.mark.slow  # a subprocess that builds TRL trainers (~30-80 s on the shared CPU)

HERE = os.path.dirname(os.path.abspath(__file__))


def grpo_opsm(logp, old, adv, mask, *, delta, rollout):
    """Our GRPO with TRL's "grpo" aggregation, under the opsm rollout-correction mode (threshold delta)."""
    w, _ = correction_weights(old, rollout, mask, "opsm", "token", 0.0, delta, logp=logp, advantages=adv)
    return grpo_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                     loss_agg_mode="seq-mean-token-mean", is_weights=w)


LOSSES = {"sapo": sapo_loss, "cispo": cispo_loss, "gmpo": gmpo_loss, "luspo": luspo_loss, "vespo": vespo_loss,
          "grpo_opsm": grpo_opsm}
PEERS = ["trl"] + (["verl"] if os.environ.get("GSPO_PEER_VERL") == "1" else [])
F64 = torch.float64


def _batch(seed, B=8, T=12, scale=0.3, one_token=False, zero_adv=False, extreme=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 4 - 0.05
    logp = old + scale * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    if one_token:
        mask = torch.arange(T)[None].expand(B, T) == 0
    if extreme:  # log-ratios of +-15 on a few tokens: ratios 3e6 and 3e-7
        logp = logp + torch.where(torch.rand(B, T, generator=g) < 0.2, 15.0, 0.0) * torch.sign(torch.randn(B, T, generator=g))
    adv = torch.zeros(B, dtype=F64) if zero_adv else torch.randn(B, generator=g, dtype=F64)
    return dict(logp=logp, old=old, adv=adv, mask=mask)


PARAMS = {
    "sapo": [dict(tau_pos=1.0, tau_neg=1.05), dict(tau_pos=0.5, tau_neg=2.0)],
    "cispo": [dict(clip_ratio_low=1.0, clip_ratio_high=4.0), dict(clip_ratio_low=1.0, clip_ratio_high=0.28)],
    "gmpo": [dict(clip_ratio_low=0.4, clip_ratio_high=0.4), dict(clip_ratio_low=0.2, clip_ratio_high=0.6)],
    "luspo": [dict(clip_ratio_low=2e-3, clip_ratio_high=2.5e-3), dict(clip_ratio_low=0.2, clip_ratio_high=0.28)],
    "vespo": [dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0),
              dict(k_pos=1.0, lambda_pos=1.5, k_neg=4.0, lambda_neg=5.0)],
    "grpo_opsm": [dict(delta=0.05), dict(delta=0.3)],
}
SCALE = {"sapo": 1.0, "cispo": 1.0, "gmpo": 0.4, "luspo": 0.004, "vespo": 0.2, "grpo_opsm": 0.3}
BATCHES = {"random": {}, "one_token": dict(one_token=True), "zero_advantages": dict(zero_adv=True),
           "extreme_ratios": dict(extreme=True)}


def _cases():
    cases = []
    for name, params in PARAMS.items():
        for k, p in enumerate(params):
            for b, (bname, kw) in enumerate(BATCHES.items()):
                batch = _batch(100 * k + b, scale=SCALE[name], **kw)
                if name == "grpo_opsm":  # the sampler's log-probs, apart from the old policy's
                    g = torch.Generator().manual_seed(7 + 100 * k + b)
                    p = {**p, "rollout": batch["old"] + 0.3 * torch.randn(batch["old"].shape, generator=g, dtype=F64)}
                cases.append({"id": f"{name}-{k}-{bname}", "loss": name, "params": p, **batch})
    for k, p in enumerate(PARAMS["vespo"]):  # VESPO with token IS ratios (a tenth of them masked: 0)
        batch = _batch(500 + k, scale=SCALE["vespo"])
        g = torch.Generator().manual_seed(600 + k)
        w = torch.rand(batch["logp"].shape, generator=g, dtype=F64) + 0.5
        w = torch.where(torch.rand(w.shape, generator=g) < 0.1, 0.0, w)
        cases.append({"id": f"vespo-{k}-is_weights", "loss": "vespo", "params": p, "is_weights": w, **batch})
    return cases


CASES = _cases()


@pytest.fixture(scope="module", params=PEERS)
def peer_results(request, tmp_path_factory):
    peer = request.param
    if peer == "trl":
        try:
            import trl  # noqa: F401
        except ImportError:
            pytest.fail("TRL is not installed: `pip install -e .[test]` installs trl==1.16.0 for this test")
    d = tmp_path_factory.mktemp(f"peer_{peer}")
    torch.save([{k: v for k, v in c.items() if k != "id"} | ({"rollout": c["params"]["rollout"]} if "rollout" in
                c["params"] else {}) for c in CASES], d / "in.pt")
    p = subprocess.run([sys.executable, os.path.join(HERE, "peer_losses.py"), peer, str(d / "in.pt"), str(d / "out.pt")],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return peer, dict(zip((c["id"] for c in CASES), torch.load(d / "out.pt")))


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_agrees_with_peer(peer_results, case):
    peer, results = peer_results
    got = results[case["id"]]
    if got is None:
        assert peer == "verl" and case["loss"] in ("luspo", "vespo", "grpo_opsm")  # what verl 0.9.1 lacks
        return
    logp = case["logp"].clone().requires_grad_(True)
    extra = {"is_weights": case["is_weights"]} if "is_weights" in case else {}
    loss, _ = LOSSES[case["loss"]](logp, case["old"], case["adv"], case["mask"], **case["params"], **extra)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss.detach(), got["loss"].to(F64), rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(grad, got["grad"].to(F64), rtol=1e-6, atol=1e-10)
    if case["id"].endswith("zero_advantages"):
        assert loss.item() == 0.0 and not grad.any()

"""Initial weights drawn from one seed are the same numbers under TP=2, EP=2 and TP=2 x EP=2
(bit for bit through dist_checkpointing's global keys). Weights saved once (torch_dist) and loaded under TP=2, EP=2 and TP=2 x EP=2
give the single-rank logits, log-probs, entropy (also from the fused output-layer log-probs under TP=2) (checked inside the ranks, fp32, 1e-5; also for an
odd sequence length, which sequence parallel under TP=2 pads) and the single-rank gradients of a
scalar loss (checked here, tensor by tensor on global keys)."""

import pytest
import torch

from megatron_gspo.checkpoint import dist_checkpoint_to_tensors

pytestmark = pytest.mark.slow  # trainer subprocesses under torchrun / the launcher

LAYOUTS = {
    "tp2": (2, ["--tp", "2"]),
    "ep2": (2, ["--ep", "2"]),
    "tp2ep2": (4, ["--tp", "2", "--ep", "2"]),
    # log-probs from the hidden states with the output layer fused in (vocabulary chunks, sequence
    # parallel), against the one-rank logits path
    "tp2_fused": (2, ["--tp", "2", "--logprobs", "fused"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, run_dist, run_dist_jobs):
    """The one-rank reference, then every layout's check (those of a world size in one torchrun: jobs.py):
    (the directory, each world size's output)."""
    d = tmp_path_factory.mktemp("parity")
    run_dist("parity.py", 1, "--mode", "ref", "--dir", str(d))
    return d, run_dist_jobs({k: (n, ["parity.py", "--mode", "check", "--dir", d, "--tag", k, *args])
                             for k, (n, args) in LAYOUTS.items()}, d)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(reference, layout):
    reference, out = reference
    nproc, _ = LAYOUTS[layout]
    # every rank printed its comparison of logits / lp / ent / odd-length logits (SP padding)
    assert out[layout].count("max abs diff") == 4 * nproc, out[layout]
    # the initial weights this layout drew from the seed are the one-rank model's, bit for bit
    init_ref = dist_checkpoint_to_tensors(str(reference / "weights"))
    init_got = dist_checkpoint_to_tensors(str(reference / f"init_{layout}"))
    differ = [k for k, v in init_ref.items() if isinstance(v, torch.Tensor) and not torch.equal(v, init_got[k])]
    assert not differ, f"{layout}: initial weights depend on the layout: {differ}"
    ref = dist_checkpoint_to_tensors(str(reference / "grads_ref"))
    got = dist_checkpoint_to_tensors(str(reference / f"grads_{layout}"))
    tensors = [k for k, v in ref.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 10 and set(tensors) <= set(got)
    for k in tensors:
        scale = ref[k].abs().max().item()
        assert scale > 0, f"reference gradient of {k} is zero: the loss does not reach it"
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= 1e-5 * max(1.0, scale), f"{layout}: grad {k} differs by {err:.3e} (scale {scale:.3e})"

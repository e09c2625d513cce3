"""Device discipline without a GPU: the code that will run on CUDA creates its tensors on the
parallel state's device and hands collectives tensors their backend can move.

Two tools make CPU tests able to see what only a GPU run would: ``cuda_on_cpu()`` (tests/cuda_on_cpu.py:
tensors that report ``cuda:0`` and refuse to meet CPU tensors, data and autograd kept on the CPU; a
FakeTensorMode equivalent that survives host syncs) and ``FakeNccl``, a transport for comm.py that
claims NCCL and records the device of every collective's tensor. And one static check: no module
calls a ``torch.distributed`` collective except through comm.py, the module that checks devices.
"""

import ast
import os
import types

import pytest
import torch

from cuda_on_cpu import CudaOnCpu, DeviceMismatch, FakeNccl, cuda_on_cpu
from megatron_gspo.runtime import comm

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_gspo")
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "barrier", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce"}


@pytest.fixture
def nccl(monkeypatch):
    """comm.py's transport replaced by a recording NCCL stand-in (2 ranks)."""
    fake = FakeNccl(world=2)
    monkeypatch.setattr(comm, "_transport", fake)
    return fake


def _group(size=1):
    return types.SimpleNamespace(size=lambda: size)


# ----------------------------------------------------------------------------------------------
# the tools themselves can fail
# ----------------------------------------------------------------------------------------------


def test_cuda_on_cpu_refuses_a_cpu_cuda_mix_like_cuda_does():
    with cuda_on_cpu():
        x = torch.ones(4, device="cuda")
        assert isinstance(x, CudaOnCpu) and x.device.type == "cuda"
        assert (x * 2 + torch.tensor(1.0)).device.type == "cuda"  # 0-dim CPU scalars are fine on CUDA
        with pytest.raises(DeviceMismatch, match="CPU tensor"):
            x + torch.ones(4)
        with pytest.raises(DeviceMismatch):
            torch.where(torch.ones(4, dtype=torch.bool), x, torch.zeros(4))
        assert x.cpu().device.type == "cpu" and x[torch.tensor([0, 2])].device.type == "cuda"


def test_comm_refuses_a_tensor_its_backend_cannot_move(nccl):
    with pytest.raises(comm.CollectiveDeviceError, match="my vote.*nccl.*cuda tensors only"):
        comm.all_reduce(torch.ones(1), "max", object(), what="my vote")
    assert nccl.calls == []  # refused before any communication
    with cuda_on_cpu():
        comm.all_reduce(torch.ones(1, device="cuda"), "sum", object(), what="ok")
    assert nccl.calls == [("all_reduce", "cuda")]


def test_every_collective_of_the_package_goes_through_comm():
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path.endswith(os.path.join("megatron_gspo", "runtime", "comm.py")):
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
                    base = ast.unparse(node.value)
                    if base in ("dist", "torch.distributed") or base.endswith(".distributed"):
                        offenders.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno} {base}.{node.attr}")
    assert not offenders, f"collectives outside megatron_gspo/runtime/comm.py: {offenders}"


# ----------------------------------------------------------------------------------------------
# the math, with CUDA inputs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,extra", [
    ("gspo", {}), ("gspo_token", {"loss.kl_coef": 0.1}),
    ("grpo", {"loss.dual_clip_c": 3.0, "loss.entropy_coef": 0.01}),
    ("grpo", {"loss.loss_agg_mode": "seq-mean-token-sum-norm", "loss.loss_agg_norm_constant": 8.0}),
])
def test_losses_metrics_and_their_reduction_stay_on_cuda(nccl, name, extra):
    from megatron_gspo.config import from_dict
    from megatron_gspo.algorithms.losses import LossConfig, batch_normalizer, compute_policy_loss
    from megatron_gspo.runtime.metrics import MetricAccumulator

    cfg = from_dict(LossConfig, {"name": name, **{k.split(".")[1]: v for k, v in extra.items()}})
    g = torch.Generator().manual_seed(0)
    with cuda_on_cpu():
        logp = (-torch.rand(4, 6, generator=g)).to("cuda").requires_grad_(True)
        old = (logp.detach() + 0.01 * torch.randn(4, 6, generator=g).to("cuda"))
        mask = torch.ones(4, 6, dtype=torch.bool, device="cuda")
        mask[1, 4:] = False
        adv = torch.tensor([1.0, -1.0, 0.5, 0.0], device="cuda")
        ref = logp.detach() - 0.05
        ent = torch.rand(4, 6, generator=g).to("cuda")
        norm = comm.all_reduce(batch_normalizer(cfg, mask).reshape(1), "sum", object(), what="normalizer")
        loss, metrics = compute_policy_loss(cfg, logp, old, adv, mask, ref_logp=ref, entropy=ent,
                                            global_batch_normalizer=norm[0])
        assert loss.device.type == "cuda"
        loss.backward()
        assert all(m.stats.device.type == "cuda" for m in metrics.values())
        acc = MetricAccumulator()
        acc.add(metrics)
        acc.add(metrics)
        out = acc.reduce(object())
    # one rank's numbers (the stand-in transport adds nothing): the reduced loss is the loss itself
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert nccl.calls and all(dev == "cuda" for _, dev in nccl.calls), nccl.calls


def test_advantages_and_rewards_to_tensor_on_cuda():
    from megatron_gspo.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from megatron_gspo.data.rewards import compute_rewards

    with cuda_on_cpu():
        r = compute_rewards(lambda p, resp, a: float(len(resp)), ["p"] * 6, ["a", "bb", "a", "ccc", "dd", "e"],
                            device=torch.device("cuda", 0))
        assert r.device.type == "cuda" and r.tolist() == [1, 2, 1, 3, 2, 1]
        for name, fn in ADVANTAGE_ESTIMATORS.items():
            adv = fn(r, 3)
            assert adv.device.type == "cuda", name
        assert ADVANTAGE_ESTIMATORS["dr_grpo"](r, 3).tolist() == pytest.approx([-1 / 3, 2 / 3, -1 / 3, 1, 0, -1])


def test_logprobs_forward_backward_and_tp_collectives_on_cuda(nccl):
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(1)
    with cuda_on_cpu():
        logits = torch.randn(2, 5, 16, generator=g).to("cuda").requires_grad_(True)
        target = torch.randint(0, 12, (2, 5), generator=g).to("cuda")
        lp, ent = vocab_parallel_logprobs(logits, target, vocab_size=12, temperature=0.7)
        assert lp.device.type == "cuda" and ent.device.type == "cuda"
        (lp.sum() + ent.sum()).backward()  # the custom backward's own tensors are checked too
        # vocab-parallel: the shard's statistics travel through comm.py on cuda
        lp, _ = vocab_parallel_logprobs(logits.detach(), target, vocab_size=24, tp_group=object(), with_entropy=False)
        assert lp.device.type == "cuda"
    assert nccl.calls and all(dev == "cuda" for _, dev in nccl.calls), nccl.calls


def test_fused_output_layer_logprobs_forward_backward_and_tp_collectives_on_cuda(nccl):
    from megatron_gspo.model.fused_logprobs import output_layer_logprobs

    g = torch.Generator().manual_seed(2)
    with cuda_on_cpu():
        hidden = torch.randn(2, 5, 8, generator=g).to("cuda").requires_grad_(True)
        weight = torch.randn(16, 8, generator=g).to("cuda").requires_grad_(True)
        target = torch.randint(0, 12, (2, 5), generator=g).to("cuda")
        for keep in (1 << 30, 0):  # chunk logits kept for the backward, or recomputed
            lp, ent = output_layer_logprobs(hidden, weight, target, vocab_size=12, temperature=0.7,
                                            chunk_bytes=16 * 4 * 10, keep_logits_bytes=keep)
            assert lp.device.type == "cuda" and ent.device.type == "cuda"
            (lp.sum() + ent.sum()).backward()  # the custom backward's own tensors are checked too
        assert hidden.grad is not None and weight.grad is not None
        lp, _ = output_layer_logprobs(hidden.detach(), weight.detach(), target, vocab_size=24, tp_group=object(),
                                      with_entropy=False)
        assert lp.device.type == "cuda"
    assert nccl.calls and all(dev == "cuda" for _, dev in nccl.calls), nccl.calls


def test_sampling_noise_and_draw_on_cuda():
    from megatron_gspo.generation.sampling import counter_uniform, sample_tokens

    with cuda_on_cpu():
        rows = torch.arange(6, device="cuda")
        u = counter_uniform(5, rows, 2)
        tok, lp = sample_tokens(torch.randn(6, 10).to("cuda"), 0.8, top_k=4, top_p=0.9, uniform=u)
        assert u.device.type == tok.device.type == lp.device.type == "cuda"
    assert torch.equal(u.cpu(), counter_uniform(5, torch.arange(6), 2))  # same bits as on the CPU


# ----------------------------------------------------------------------------------------------
# the trainer's helpers: tensors for collectives and for the model made on the state's device
# ----------------------------------------------------------------------------------------------


def test_rollout_helpers_make_their_tensors_on_the_state_device(nccl):
    from megatron_gspo.algorithms.advantages import grpo_advantages
    from megatron_gspo.algorithms.losses import LossConfig, batch_normalizer
    from megatron_gspo.model.gpt import aux_loss_scales, input_padding_mask
    from megatron_gspo.rollout.prepare import TrainBatch, global_advantages
    from megatron_gspo.rollout.rows import common_length, local_rows

    cuda = torch.device("cuda", 0)
    state = types.SimpleNamespace(device=cuda, dp_group=object(), sequence_parallel=True, tp=2, tp_rank=1,
                                  pg=types.SimpleNamespace(tp_cp=_group(1), tp_dp_cp=_group(1)))
    with cuda_on_cpu():
        assert common_length(7, 2, cuda, group=object()) == 7
        assert comm.any_rank(True, cuda, what="vote") and comm.max_int(3, cuda, what="width") == 3
        rows = local_rows(8, 2, 2, 0)
        assert rows == [0, 1, 4, 5]
        rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], device=cuda)
        ids = torch.tensor(rows, device=cuda)
        adv = global_advantages(rewards, ids, 8, 4, grpo_advantages, 2, 2, object())
        assert adv.device.type == "cuda" and adv.shape == (4,)
        lengths = torch.tensor([3, 5, 4, 2], device=cuda)
        pad = input_padding_mask(lengths, 5)
        assert pad.device.type == "cuda" and pad.sum(1).tolist() == [3, 1, 2, 4]
        scales = aux_loss_scales([pad[:2], pad[2:]], state, "aux_loss", 1e-3)
        assert len(scales) == 2 and all(s > 0 for s in scales)
        # the default, per sequence: coeff / the step's sequences (4 rows, each with a token), counted on the device
        assert aux_loss_scales([pad[:2], pad[2:]], state, "seq_aux_loss", 1e-3) == [1e-3 / 4] * 2
        batch = TrainBatch(tokens=torch.zeros(4, 6, dtype=torch.long, device=cuda), mask=~pad, seq_lengths=lengths,
                             row_ids=ids, rewards=rewards, advantages=adv, sample_logprobs=torch.zeros(4, 5, device=cuda))
        assert batch.rows(slice(1, 3)).input_padding_mask().device.type == "cuda"
        assert batch_normalizer(LossConfig(), batch.mask).device.type == "cuda"
    assert nccl.calls and all(dev == "cuda" for _, dev in nccl.calls), nccl.calls


def test_sft_batch_is_built_on_the_state_device():
    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.trainer.sft import build_sft_batch
    from megatron_gspo.data.tokenizer import CharTokenizer

    tok = CharTokenizer()
    prompts = [Prompt(id="a", text="1+2=", ids=tok.encode("1+2="), answer="3"),
               Prompt(id="b", text="9+9=", ids=tok.encode("9+9="), answer="18")]
    with cuda_on_cpu():
        tokens, mask, lengths = build_sft_batch(prompts, tok, pad_id=0, device=torch.device("cuda", 0))
        assert tokens.device.type == mask.device.type == lengths.device.type == "cuda"
    assert lengths.tolist() == [6, 7] and mask.sum(1).tolist() == [2, 3]  # answer + eos


# ----------------------------------------------------------------------------------------------
# In-process tests state their device: on "a GPU machine with Transformer Engine" they still build
# the CPU model of megatron's local spec they were written for
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_and_te(monkeypatch):
    """This machine as an NGC container looks to the project's device and spec decisions: one visible GPU
    (torch.cuda.is_available / device_count, what parallel.resolve_device asks) and a Transformer Engine that
    imports (model.resolve_impl's answer from compat.te_status). Nothing else is faked (megatron's own
    workarounds still see the TE this machine really lacks), so whatever a test builds under it is built for
    real, on the CPU if it means it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("megatron_gspo.model.gpt.te_status", lambda: (True, "Transformer Engine (stood in for) imports"))


def test_auto_on_a_gpu_machine_with_te_is_cuda_and_the_te_spec(gpu_and_te):
    """Why tests must say what they mean: the defaults there are a CUDA job on the TE spec."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig, model_config_from_preset
    from megatron_gspo.model.gpt import resolve_expert_impl, resolve_impl

    dev = parallel.resolve_device(ParallelConfig(), local_rank=0)
    cfg = model_config_from_preset("tiny")
    assert dev == torch.device("cuda", 0) and resolve_impl(cfg, dev) == "transformer_engine"
    assert resolve_expert_impl(cfg, resolve_impl(cfg, dev)) == "te_grouped"
    assert resolve_impl(cfg, parallel.resolve_device(ParallelConfig(device="cpu"))) == "local"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_in_process_fixtures_build_the_local_cpu_model_on_a_gpu_machine_with_te(gpu_and_te, single_rank, tied):
    """The single_rank fixture and the module fixtures' ParallelConfig(device="cpu", ...) (test_decode.py,
    test_experts.py, ...) under the GPU + TE stand-in: a CPU state, every parameter on the CPU, the local spec
    with the project's own modules, and a model the lean decoder takes."""
    from megatron_gspo.model.attention import SDPAttention
    from megatron_gspo.config import ParallelConfig, model_config_from_preset
    from megatron_gspo.generation.lean_decoder import lean_decode_unsupported
    from megatron_gspo.model.experts import BatchedSequentialMLP
    from megatron_gspo.model.gpt import RMSNorm, build_model

    cfg = model_config_from_preset("tiny", vocab_size=100, untie_embeddings_and_output_weights=not tied)
    st = single_rank(cfg)  # the fixture's own default
    assert st.device == torch.device("cpu")
    for par in (ParallelConfig(device="cpu", seed=5), ParallelConfig(device="cpu")):
        m = build_model(cfg, par, st)
        assert not m.construct_only and all(p.device.type == "cpu" for p in m.parameters())
        layer = m.decoder.layers[0]
        assert isinstance(layer.input_layernorm, RMSNorm)
        assert isinstance(layer.self_attention.core_attention, SDPAttention)
        assert isinstance(layer.mlp.experts, BatchedSequentialMLP)
        assert lean_decode_unsupported(m) is None
    # (no forward under the stand-in: torch itself then believes in a GPU, e.g. torch.compile saves CUDA RNG
    # states; the same fixtures' forwards run in their own tests)


def test_an_in_process_test_that_does_not_state_its_device_fails(in_process_tests_state_their_device):
    """tests/conftest.py's guard: parallel.device=auto from a test not marked gpu fails the test, on every
    machine, so a forgotten device shows on the CPU too."""
    from megatron_gspo.config import ParallelConfig, model_config_from_preset

    with pytest.raises(pytest.fail.Exception, match=r"parallel\.device=auto in an in-process test"):
        in_process_tests_state_their_device(model_config_from_preset("tiny"), ParallelConfig())

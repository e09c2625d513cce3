"""HF <-> Megatron conversion (checkpoints_tools) with the Transformer Engine spec on the Megatron side, built
construct-only on the CPU: a tiny random Qwen3-MoE written by transformers converts to torch_dist, loads
strictly into the TE-spec model through megatron_gspo.checkpoint.load_model (the converter writes what the TE
spec requests: its norm extra states included), holds exactly the local spec's tensors from the same files,
and exports back to HF bit for bit from a checkpoint the TE-spec model saved itself."""

import json
import os

import pytest
import torch

from checkpoints_tools import hf_to_megatron, megatron_to_hf
from checkpoints_tools.megatron_to_hf import load_model_config
from te_spec_names import sharded_keys, te_to_local, tensors

TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            max_position_embeddings=256, rope_theta=10000.0, norm_topk_prob=True, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


def hf_tensors(d):
    from safetensors import safe_open

    out = {}
    for f in sorted(n for n in os.listdir(d) if n.endswith(".safetensors")):
        with safe_open(os.path.join(d, f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module")
def hf_and_mcore(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("te_conv")
    hf = str(root / "hf")
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY))
    with torch.no_grad():  # every tensor distinct (norms away from 1)
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in n else p.normal_(0, 0.15)
    m.save_pretrained(hf, max_shard_size="200KB")
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}, f)
    mcore = str(root / "mcore")
    assert hf_to_megatron.main(["--hf-dir", hf, "--out", mcore, "--quiet"]) == 0
    return hf, mcore, root


def test_hf_to_te_spec_to_hf_is_bit_exact(hf_and_mcore, cpu_models):
    from megatron_gspo.checkpoint import load_model, save_model

    hf, mcore, root = hf_and_mcore
    cfg = load_model_config(os.path.join(mcore, "model_config.yaml"))
    te, _ = cpu_models(cfg, "te", seed=9)
    load_model(te, mcore)  # strict, every tensor and the extra states TE requests
    local, _ = cpu_models(cfg, "local", seed=10)
    load_model(local, mcore)
    # the same numbers in both specs (names as tests/te/test_te_checkpoints.py maps them)
    lt = tensors(local)
    for k, v in tensors(te).items():
        assert torch.equal(v, lt[te_to_local(k)]), k
    src = hf_tensors(hf)
    qkv_norm = te.decoder.layers[1].self_attention.linear_qkv.layer_norm_weight
    assert torch.equal(qkv_norm, src["model.layers.1.input_layernorm.weight"])
    # the TE-spec model's own checkpoint exports to the original HF tensors, bit for bit
    saved = str(root / "te_saved")
    save_model(te, saved)
    out = str(root / "hf_back")
    assert megatron_to_hf.main(["--ckpt", saved, "--out", out, "--tokenizer-dir", hf, "--quiet",
                                "--model-config", os.path.join(mcore, "model_config.yaml")]) == 0
    got = hf_tensors(out)
    assert got.keys() == src.keys() and len(src) > 20
    for k, v in src.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_converter_output_holds_every_entry_the_te_spec_requests(hf_and_mcore, cpu_models):
    """The converter's key list against the real TE model's sharded state dict (tests/test_conversion.py
    checks a few of these names by hand; here every one, from the model)."""
    from megatron_gspo.checkpoint.storage import checkpoint_metadata, missing_extra_states

    _, mcore, _ = hf_and_mcore
    te, _ = cpu_models(load_model_config(os.path.join(mcore, "model_config.yaml")), "te")
    meta = checkpoint_metadata(mcore)
    assert sharded_keys(te) <= set(meta)
    assert missing_extra_states(te.sharded_state_dict(), meta) == []

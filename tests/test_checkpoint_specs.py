"""A checkpoint of one layer spec loads into the other (megatron_gspo.checkpoint.storage): the local spec
saves no extra state for its norms where the Transformer Engine spec has one per TE module, so a load
requests only the extra states the checkpoint holds and keeps the model's own for the rest; any other
missing entry is still refused by name. The real specs on both sides are tests/te/test_te_checkpoints.py
(the TE tier); here, on any machine, a local-spec checkpoint with some extra states taken out of its
metadata stands for "written by the other spec"."""

import dataclasses
import pickle

import pytest
import torch

from megatron_gspo.checkpoint import load_model, save_model
from megatron_gspo.checkpoint.torch_dist_files import read_dcp_metadata
from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.errors import CheckpointError
from megatron_gspo.model.gpt import build_model

CFG = model_config_from_preset("tiny", transformer_impl="local")


def drop_from_metadata(ckpt, startswith: str) -> list:
    """Take every entry whose key starts with ``startswith`` out of a torch_dist checkpoint's metadata."""
    path = f"{ckpt}/.metadata"
    md = read_dcp_metadata(ckpt)  # never pickle.load: the project reads .metadata restricted
    gone = [k for k in md.state_dict_metadata if k.startswith(startswith)]
    for k in gone:
        del md.state_dict_metadata[k]
    md.storage_data = {k: v for k, v in md.storage_data.items() if not k.fqn.startswith(startswith)}
    pickle.dump(md, open(path, "wb"))
    return gone


@pytest.fixture
def saved(single_rank, tmp_path):
    par = ParallelConfig(device="cpu", seed=3)
    st = single_rank(CFG, par)
    src = build_model(CFG, par, st)
    save_model(src, str(tmp_path / "ckpt"))
    dst = build_model(CFG, dataclasses.replace(par, seed=4), st)
    return src, dst, str(tmp_path / "ckpt")


def _weights(m):
    return {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}


def test_a_checkpoint_without_some_extra_states_loads_strictly(saved):
    src, dst, ckpt = saved
    assert len(drop_from_metadata(ckpt, "decoder.layers.self_attention.linear_qkv._extra_state")) == 2
    load_model(dst, ckpt)  # strict: the extra states it lacks are the model's own
    want = _weights(src)
    assert all(torch.equal(v, want[k]) for k, v in _weights(dst).items())


def test_a_checkpoint_without_a_tensor_is_refused_by_name(saved):
    _, dst, ckpt = saved
    drop_from_metadata(ckpt, "decoder.layers.self_attention.q_layernorm.weight")
    with pytest.raises(CheckpointError, match=r"checkpoint lacks 1 model tensors, e\.g\. "
                                              r"\['decoder\.layers\.self_attention\.q_layernorm\.weight'\]"):
        load_model(dst, ckpt)

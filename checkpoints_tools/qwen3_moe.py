"""Qwen3-MoE (HF ``model_type: qwen3_moe``) <-> megatron-core GPTModel: the parameter mapping,
both directions, in one place.

Megatron side: torch_dist global keys of megatron_gspo's GPTModel (local spec; the Transformer
Engine spec's spelling of the pre-MLP norm is an alias). Layers are stacked on a leading axis,
experts on a second one; each rule below converts one (layer) or (layer, expert) chunk.

    HF (hub on-disk layout)                                Megatron torch_dist key [chunk]
    model.embed_tokens.weight [V,H]                        embedding.word_embeddings.weight [Vpad,H] (zero rows >= V)
    model.layers.L.input_layernorm.weight                  decoder.layers.self_attention.linear_qkv.layer_norm_weight [L]
    model.layers.L.self_attn.{q,k,v}_proj.weight           decoder.layers.self_attention.linear_qkv.weight [L]  (interleaved per KV group)
    model.layers.L.self_attn.o_proj.weight                 decoder.layers.self_attention.linear_proj.weight [L]
    model.layers.L.self_attn.{q,k}_norm.weight             decoder.layers.self_attention.{q,k}_layernorm.weight [L]
    model.layers.L.post_attention_layernorm.weight         decoder.layers.pre_mlp_layernorm.weight [L]
                                                             (alias read: decoder.layers.mlp.linear_fc1.layer_norm_weight)
    model.layers.L.mlp.gate.weight [E,H]                   decoder.layers.mlp.router.weight [L]
    model.layers.L.mlp.experts.E.{gate,up}_proj.weight     decoder.layers.mlp.experts.experts.linear_fc1.weight [L,E]  ([gate; up])
    model.layers.L.mlp.experts.E.down_proj.weight          decoder.layers.mlp.experts.experts.linear_fc2.weight [L,E]
    model.norm.weight                                      decoder.final_layernorm.weight
    lm_head.weight [V,H]                                   output_layer.weight [Vpad,H] (zero rows >= V)

Fused QKV: for each of the num_key_value_heads groups, that group's (nq / nkv) query heads, then
its key head, then its value head (head_dim rows each).

The expert keys are the same for megatron's SequentialMLP (local spec) and TEGroupedMLP (TE spec):
TEGroupedMLP.sharded_state_dict maps its in-memory ``linear_fc1.weight{i}`` to the global
``...experts.experts.linear_fc1.weight`` with the expert axis and the same [gate; up] SwiGLU split.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from checkpoints_tools.errors import ConversionError
from checkpoints_tools.mapping import Group, ModelMapping, MTensor, Rule, extra_state_key, register

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _identity_in(ts):
    return ts[0]


def _identity_out(t):
    return [t]


@register
class Qwen3MoeMapping(ModelMapping):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    # ------------------------------------------------------------------------------------------
    # config
    # ------------------------------------------------------------------------------------------
    @classmethod
    def model_config_from_hf(cls, hf_config: dict):
        from megatron_gspo.config import ConfigError, model_config_from_hf

        hf = dict(hf_config)
        dtype = hf.get("torch_dtype") or hf.get("dtype")
        try:
            return model_config_from_hf(hf, precision="bf16" if dtype == "bfloat16" else "fp32")
        except ConfigError as e:
            msg = str(e)
            if msg.startswith(str(hf)):  # model_config_from_hf names its source, here a dict
                msg = msg[len(str(hf)):].lstrip(": ")
            raise ConversionError(f"HF config.json: {msg}") from None

    def hf_config(self, base: Optional[dict], dtype: torch.dtype) -> dict:
        c = self.cfg
        out = copy.deepcopy(base) if base else {
            "intermediate_size": c.moe_ffn_hidden_size * c.moe_router_topk,
            "initializer_range": c.init_method_std,
            "router_aux_loss_coef": c.moe_aux_loss_coeff,
            "use_cache": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": c.num_layers,
            "attention_dropout": 0.0,
            "output_router_logits": False,
            "rope_scaling": None,
        }
        out.update({
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_query_groups,
            "head_dim": c.kv_channels,
            "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.norm_epsilon,
            "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": c.moe_ffn_hidden_size,
            "num_experts_per_tok": c.moe_router_topk,
            "norm_topk_prob": not c.moe_router_pre_softmax,
        })
        if "num_local_experts" in out and "num_experts" not in out:
            out["num_local_experts"] = c.num_moe_experts
        else:
            out["num_experts"] = c.num_moe_experts
        if isinstance(out.get("rope_parameters"), dict):
            out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": c.rotary_base}
        else:
            out["rope_theta"] = c.rotary_base
        name = _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
        if "dtype" in out:
            out["dtype"] = name
        if "torch_dtype" in out or "dtype" not in out:
            out["torch_dtype"] = name
        return out

    def hint(self, name: str) -> str:
        if "embed_tokens" in name or "lm_head" in name or "word_embeddings" in name or "output_layer" in name:
            return "vocab_size / make_vocab_size_divisible_by"
        if ".mlp.gate." in name or ".experts." in name or "router" in name:
            return "num_experts / moe_intermediate_size"
        if "self_attn" in name or "self_attention" in name:
            return "num_attention_heads / num_key_value_heads / head_dim"
        if name.startswith("model.layers."):
            return "num_hidden_layers"
        return ""

    # ------------------------------------------------------------------------------------------
    # tensors
    # ------------------------------------------------------------------------------------------
    def _tensors(self) -> dict[str, MTensor]:
        c = self.cfg
        L, H, d = c.num_layers, c.hidden_size, c.kv_channels
        nq, nkv, E, F, Vp = (c.num_attention_heads, c.num_query_groups, c.num_moe_experts,
                             c.moe_ffn_hidden_size, c.padded_vocab_size)
        t = {
            "emb": MTensor("embedding.word_embeddings.weight", (Vp, H)),
            "in_ln": MTensor("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (L, H), 1),
            "qkv": MTensor("decoder.layers.self_attention.linear_qkv.weight", (L, (nq + 2 * nkv) * d, H), 1),
            "proj": MTensor("decoder.layers.self_attention.linear_proj.weight", (L, H, nq * d), 1),
            "q_ln": MTensor("decoder.layers.self_attention.q_layernorm.weight", (L, d), 1),
            "k_ln": MTensor("decoder.layers.self_attention.k_layernorm.weight", (L, d), 1),
            # both specs save it under this name (model.build_layer_spec); the alias reads
            # checkpoints written with megatron's default local-spec key map
            "mlp_ln": MTensor("decoder.layers.pre_mlp_layernorm.weight", (L, H), 1,
                              aliases=("decoder.layers.mlp.linear_fc1.layer_norm_weight",)),
            "router": MTensor("decoder.layers.mlp.router.weight", (L, E, H), 1),
            "fc1": MTensor("decoder.layers.mlp.experts.experts.linear_fc1.weight", (L, E, 2 * F, H), 2),
            "fc2": MTensor("decoder.layers.mlp.experts.experts.linear_fc2.weight", (L, E, H, F), 2),
            "final_ln": MTensor("decoder.final_layernorm.weight", (H,)),
        }
        if c.untie_embeddings_and_output_weights:
            t["out"] = MTensor("output_layer.weight", (Vp, H))
        return t

    def megatron_tensors(self) -> list[MTensor]:
        return list(self._tensors().values())

    def groups(self) -> list[Group]:
        c = self.cfg
        T = self._tensors()
        L, H, d = c.num_layers, c.hidden_size, c.kv_channels
        nq, nkv, E, F = c.num_attention_heads, c.num_query_groups, c.num_moe_experts, c.moe_ffn_hidden_size
        V, Vp = c.vocab_size, c.padded_vocab_size
        qpg = nq // nkv

        def pad_vocab(ts):
            out = ts[0].new_zeros((Vp, H))
            out[:V] = ts[0]
            return out

        def unpad_vocab(t):
            return [t[:V]]

        def qkv_in(ts):
            q, k, v = ts
            return torch.cat([q.reshape(nkv, qpg, d, H), k.reshape(nkv, 1, d, H), v.reshape(nkv, 1, d, H)],
                             dim=1).reshape((nq + 2 * nkv) * d, H)

        def qkv_out(t):
            x = t.reshape(nkv, qpg + 2, d, H)
            return [x[:, :qpg].reshape(nq * d, H), x[:, qpg].reshape(nkv * d, H), x[:, qpg + 1].reshape(nkv * d, H)]

        def fc1_in(ts):
            return torch.cat(ts, dim=0)

        def fc1_out(t):
            return [t[:F], t[F:]]

        def rule(key, index, names, shapes, fin=_identity_in, fout=_identity_out):
            return Rule(T[key], tuple(index), tuple(names), tuple(tuple(s) for s in shapes), fin, fout)

        groups = [Group("embedding", [rule("emb", (), ["model.embed_tokens.weight"], [(V, H)], pad_vocab, unpad_vocab)])]
        for l in range(L):
            p = f"model.layers.{l}."
            g = Group(f"layer {l}")
            g.rules += [
                rule("in_ln", (l,), [p + "input_layernorm.weight"], [(H,)]),
                rule("qkv", (l,), [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                     [(nq * d, H), (nkv * d, H), (nkv * d, H)], qkv_in, qkv_out),
                rule("proj", (l,), [p + "self_attn.o_proj.weight"], [(H, nq * d)]),
                rule("q_ln", (l,), [p + "self_attn.q_norm.weight"], [(d,)]),
                rule("k_ln", (l,), [p + "self_attn.k_norm.weight"], [(d,)]),
                rule("mlp_ln", (l,), [p + "post_attention_layernorm.weight"], [(H,)]),
                rule("router", (l,), [p + "mlp.gate.weight"], [(E, H)]),
            ]
            # `_extra_state` objects a load requests: local spec (linear layers) and TE spec
            # (TE linears, TE norms), keyed per layer / per (layer, expert) like megatron's save.
            for k in ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.q_layernorm",
                      "self_attention.k_layernorm", "pre_mlp_layernorm"):
                g.objects.append(extra_state_key(f"decoder.layers.{k}._extra_state", (l,), (L,)))
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                g.rules += [
                    rule("fc1", (l, e), [q + "gate_proj.weight", q + "up_proj.weight"], [(F, H), (F, H)], fc1_in, fc1_out),
                    rule("fc2", (l, e), [q + "down_proj.weight"], [(H, F)]),
                ]
                for k in ("linear_fc1", "linear_fc2"):
                    g.objects.append(extra_state_key(f"decoder.layers.mlp.experts.experts.{k}._extra_state", (l, e), (L, E)))
            groups.append(g)
        final = Group("final", [rule("final_ln", (), ["model.norm.weight"], [(H,)])],
                      objects=[extra_state_key("decoder.final_layernorm._extra_state")])
        if c.untie_embeddings_and_output_weights:
            final.rules.append(rule("out", (), ["lm_head.weight"], [(V, H)], pad_vocab, unpad_vocab))
        groups.append(final)
        return groups

"""Peers' implementations of SAPO, CISPO, GMPO, LUSPO, VESPO and the off-policy sequence mask (OPSM), run on given batches (tests/test_loss_peers.py).

    python tests/peer_losses.py trl IN.pt OUT.pt     # TRL's GRPOTrainer / GMPOTrainer._compute_loss
    python tests/peer_losses.py verl IN.pt OUT.pt    # verl's core_algos policy losses (where verl is installed)

IN.pt: a list of cases ``{"loss", "params", "logp", "old", "adv", "mask"}`` ([B, T] tensors, [B]
advantages); OUT.pt: per case ``{"loss": scalar, "grad": [B, T] d loss / d logp}``, or None where the peer lacks the loss. Runs in its own
process: constructing a TRL trainer sets up accelerate's process state and importing verl configures
logging and imports ray, neither of which belongs in the test process.

TRL's losses live in a trainer method, so this builds a real ``GRPOTrainer`` (``GMPOTrainer`` for GMPO)
from a real ``GRPOConfig`` on a tiny random model and calls its ``_compute_loss`` with the batch; the
only substitution is the per-token log-prob provider, which returns the batch's log-probs (a leaf
tensor, so the gradient w.r.t. them is read off directly) instead of running the model.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import torch


def _tiny_hf_parts(tmp: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "a", "b", "c", "d"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=len(vocab), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64))
    return tok, model


def run_trl(cases: list[dict]) -> list[dict]:
    import datasets
    from trl import GRPOConfig, GRPOTrainer
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        tok, model = _tiny_hf_parts(tmp)
        data = datasets.Dataset.from_list([{"prompt": "a b"}] * 4)
        for case in cases:
            p = case["params"]
            common = dict(output_dir=tmp, use_cpu=True, report_to="none", save_strategy="no", beta=0.0,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
                          steps_per_generation=1, gradient_accumulation_steps=1, disable_tqdm=True)
            if case["loss"] == "gmpo":
                cfg = GMPOConfig(epsilon=p["clip_ratio_low"], epsilon_high=p["clip_ratio_high"], **common)
                cls = GMPOTrainer
            elif case["loss"] == "sapo":
                cfg = GRPOConfig(loss_type="sapo", sapo_temperature_pos=p["tau_pos"],
                                 sapo_temperature_neg=p["tau_neg"], **common)
                cls = GRPOTrainer
            elif case["loss"] == "cispo":
                # TRL's epsilon_high is CISPO's absolute weight cap (ScaleRL's eps_max); no lower bound
                assert p["clip_ratio_low"] == 1.0, "TRL's CISPO has no lower bound"
                cfg = GRPOConfig(loss_type="cispo", epsilon_high=1.0 + p["clip_ratio_high"], **common)
                cls = GRPOTrainer
            elif case["loss"] == "vespo":
                cfg = GRPOConfig(loss_type="vespo", vespo_k_pos=p["k_pos"], vespo_lambda_pos=p["lambda_pos"],
                                 vespo_k_neg=p["k_neg"], vespo_lambda_neg=p["lambda_neg"], **common)
                cls = GRPOTrainer
            elif case["loss"] == "grpo_opsm":  # GRPO (its per-sequence token mean) with the off-policy sequence mask
                cfg = GRPOConfig(loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                                 off_policy_mask_threshold=p["delta"], **common)
                cls = GRPOTrainer
            elif case["loss"] == "luspo":
                cfg = GRPOConfig(loss_type="luspo", importance_sampling_level="sequence",
                                 epsilon=p["clip_ratio_low"], epsilon_high=p["clip_ratio_high"], **common)
                cls = GRPOTrainer
            else:
                raise ValueError(case["loss"])
            trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
                          train_dataset=data, processing_class=tok)
            logp = case["logp"].clone().requires_grad_(True)
            trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
            trainer.current_gradient_accumulation_steps = 1
            trainer.model.train()
            B, T = logp.shape
            mask = case["mask"].to(torch.long)
            inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                      "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
                      "advantages": case["adv"], "old_per_token_logps": case["old"],
                      "num_items_in_batch": mask.sum().to(case["logp"].dtype)}
            if "is_weights" in case:  # the token IS ratio TRL's generation step would have made (1 off the mask)
                inputs["importance_sampling_ratio"] = torch.where(case["mask"], case["is_weights"], 1.0)
            if "rollout" in case:  # the sampler's log-probs (vLLM's), which OPSM compares the policy with
                inputs["sampling_per_token_logps"] = case["rollout"]
            loss = trainer._compute_loss(trainer.model, inputs)
            (grad,) = torch.autograd.grad(loss, logp)
            out.append({"loss": loss.detach(), "grad": grad})
    return out


def run_verl(cases: list[dict]) -> list[dict]:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    names = {"sapo": "sapo", "cispo": "cispo", "gmpo": "geo_mean"}  # verl 0.9.1 has no LUSPO
    out = []
    for case in cases:
        if case["loss"] not in names:
            out.append(None)
            continue
        p = case["params"]
        kw = dict(strategy="fsdp", rollout_n=2, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2)
        if case["loss"] == "sapo":
            kw.update(tau_pos=p["tau_pos"], tau_neg=p["tau_neg"])
        else:
            kw.update(clip_ratio_low=p["clip_ratio_low"], clip_ratio_high=p["clip_ratio_high"])
        cfg = ActorConfig(**kw)
        logp = case["logp"].clone().requires_grad_(True)
        adv = case["adv"][:, None].expand_as(logp)  # verl's advantages are per token
        loss, _ = get_policy_loss_fn(names[case["loss"]])(case["old"], logp, adv, case["mask"].to(logp.dtype),
                                                        loss_agg_mode=p.get("loss_agg_mode", "token-mean"), config=cfg)
        (grad,) = torch.autograd.grad(loss, logp)
        out.append({"loss": loss.detach(), "grad": grad})
    return out


def main() -> None:
    # run as a script, this file's directory leads sys.path, and its tests/vllm/ would import as a "vllm" package
    # without metadata (TRL then fails to parse its version)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    peer, src, dst = sys.argv[1:4]
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cases = torch.load(src)
    torch.save({"trl": run_trl, "verl": run_verl}[peer](cases), dst)


if __name__ == "__main__":
    main()

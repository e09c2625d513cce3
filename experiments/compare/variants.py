"""What is compared: the variants (overrides applied to the same job) and the ``--stress`` knobs.

Each variant uses its loss's paper defaults (GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.2, LUSPO 2e-3 / 2.5e-3,
CISPO's weight cap 5, GMPO's log-ratio range 0.4, SAPO's gate temperatures 1 / 1.05, VESPO's k / lambda
2 / 3 and 3 / 2, DPPO's deltas 0.2 (TV) and 0.05 (KL)): the job's own
clip settings are reset, since a GSPO range is meaningless for GRPO and vice versa. Per-variant
settings come on top: ``--variant-override grpo:loss.clip_ratio_high=0.28``.
"""

from __future__ import annotations

from typing import Optional

# Applied after the job's own overrides.
_RESET_CLIP = ["loss.clip_ratio_low=null", "loss.clip_ratio_high=null"]
# Quoted: overrides are parsed as YAML scalars, and YAML 1.1 reads a bare `off` as the boolean false.
_REPLAY_OFF = "train.routing_replay='off'"
VARIANTS: dict[str, dict] = {
    "gspo": dict(overrides=["loss.name=gspo", _REPLAY_OFF, *_RESET_CLIP],
                 label="GSPO", clip_unit="sequences"),
    # same gradient as gspo for per-sequence advantages
    "gspo_token": dict(overrides=["loss.name=gspo_token", _REPLAY_OFF, *_RESET_CLIP],
                       label="GSPO-token", clip_unit="sequences"),
    "grpo": dict(overrides=["loss.name=grpo", _REPLAY_OFF, *_RESET_CLIP],
                 label="GRPO", clip_unit="tokens"),
    "grpo_r2": dict(overrides=["loss.name=grpo", "train.routing_replay=R2", *_RESET_CLIP],
                    label="GRPO + R2 replay", clip_unit="tokens"),
    "grpo_r3": dict(overrides=["loss.name=grpo", "train.routing_replay=R3", *_RESET_CLIP],  # opt-in
                    label="GRPO + R3 replay", clip_unit="tokens"),
    # GSPO's successors (docs/algorithms.md): opt-in, --variants gspo,grpo,sapo,cispo,gmpo,luspo
    "sapo": dict(overrides=["loss.name=sapo", _REPLAY_OFF, *_RESET_CLIP],
                 label="SAPO", clip_unit="tokens gated below 1/2"),
    "cispo": dict(overrides=["loss.name=cispo", _REPLAY_OFF, *_RESET_CLIP],
                  label="CISPO", clip_unit="tokens (weight truncated)"),
    "gmpo": dict(overrides=["loss.name=gmpo", _REPLAY_OFF, *_RESET_CLIP],
                 label="GMPO", clip_unit="tokens"),
    "luspo": dict(overrides=["loss.name=luspo", _REPLAY_OFF, *_RESET_CLIP],
                  label="LUSPO", clip_unit="sequences"),
    # the peers' losses since GSPO and MaxRL's advantage (docs/algorithms.md): opt-in, --variants gspo,grpo,vespo,...
    "vespo": dict(overrides=["loss.name=vespo", _REPLAY_OFF, *_RESET_CLIP],
                  label="VESPO", clip_unit="tokens weighted below 1/2"),
    "dppo_tv": dict(overrides=["loss.name=dppo_tv", _REPLAY_OFF, *_RESET_CLIP],
                    label="DPPO-TV", clip_unit="tokens masked"),
    "dppo_kl": dict(overrides=["loss.name=dppo_kl", _REPLAY_OFF, *_RESET_CLIP],
                    label="DPPO-KL", clip_unit="tokens masked"),
    # prime-rl's default RL loss: DPPO-TV with Kimi-K2.5's squared log-ratio, tau 1e-3
    "dppo_tv_kl": dict(overrides=["loss.name=dppo_tv", "loss.dppo_kl_tau=1e-3", _REPLAY_OFF, *_RESET_CLIP],
                       label="DPPO-TV + KL", clip_unit="tokens masked"),
    "gspo_maxrl": dict(overrides=["loss.name=gspo", "train.advantage_estimator=maxrl", _REPLAY_OFF, *_RESET_CLIP],
                       label="GSPO + MaxRL advantages", clip_unit="sequences"),
}
FAMILY_VARIANTS = ("gspo", "grpo", "sapo", "cispo", "gmpo", "luspo")
PEER_VARIANTS = ("gspo", "grpo", "vespo", "dppo_tv", "dppo_kl", "dppo_tv_kl", "gspo_maxrl")
DEFAULT_VARIANTS = ("gspo", "gspo_token", "grpo", "grpo_r2")

# --stress makes off-policy effects visible on small models: the last of 8 minibatches is 7 updates
# stale, and the learning rate is doubled.
STRESS_MINIBATCHES = 8
STRESS_LR_MULT = 2.0


def label(variant: str) -> str:
    return VARIANTS.get(variant, {}).get("label", variant)


def clip_unit(variant: str) -> str:
    """What ``loss/clip_frac`` counts for this variant: whole sequences (GSPO, LUSPO) or tokens (GRPO, GMPO,
    CISPO's truncated weights, SAPO's gated tokens)."""
    return VARIANTS.get(variant, {}).get("clip_unit", "?")


def variant_overrides(name: str, extra: dict[str, list[str]]) -> list[str]:
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
    return VARIANTS[name]["overrides"] + extra.get(name, [])


def build_overrides(path: str, user: list[str], *, steps: Optional[int], stress: bool,
                    stress_minibatches: int = STRESS_MINIBATCHES, stress_lr_mult: float = STRESS_LR_MULT) -> list[str]:
    """The job's overrides for every variant: the user's, then --steps and --stress."""
    from megatron_gspo.config import load_job_config

    out = list(user)
    if steps is not None:
        out.append(f"train.num_steps={steps}")
    if stress:
        base = load_job_config(path, out)
        rows = base.train.prompts_per_step * base.generation.n_samples_per_prompt
        n_mb = stress_minibatches
        while rows % n_mb:  # largest divisor of the rollout <= the requested count
            n_mb -= 1
        out += [f"train.num_minibatches={n_mb}", f"optimizer.lr={base.optimizer.lr * stress_lr_mult:g}"]
    return out


def stress_text(meta: dict) -> str:
    """How a --stress run differs from the job, for titles: "--stress: 8 minibatches per rollout, lr x 2"."""
    return (f"--stress: {meta.get('num_minibatches')} minibatches per rollout, "
            f"lr x {meta.get('stress_lr_mult') or STRESS_LR_MULT:g}")


def section_kind(meta: dict) -> str:
    """The docs section a run belongs to: the one ``--section`` named, else "default", "stress" (default
    stress knobs), or "stress_<mb>mb_lr<x>x"."""
    if meta.get("section"):
        return meta["section"]
    if not meta.get("stress"):
        return "default"
    mb, mult = meta.get("stress_minibatches"), meta.get("stress_lr_mult")
    if mb in (None, STRESS_MINIBATCHES) and mult in (None, STRESS_LR_MULT):
        return "stress"
    return f"stress_{mb}mb_lr{mult:g}x"

"""megatron-gspo: GSPO (and GRPO) reinforcement-learning post-training of MoE models on megatron-core."""

__version__ = "0.1.0"

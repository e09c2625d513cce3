"""The trainer's hooks, re-exported: the interface lives in runtime/hooks.py, below both the trainer and the
rollout sources that attach hooks of their own (so rollout/ does not import trainer/)."""

from megatron_gspo.runtime.hooks import Hooks, TrainerHook

__all__ = ["Hooks", "TrainerHook"]

"""Run a training job in-process under torchrun and leave evidence for a layout comparison.

    torchrun --nproc-per-node N run_job.py --out DIR [--check-replicas] [--grads 128,32] -- overrides...

Writes to DIR (rank 0 unless said otherwise):
  metrics.jsonl              the trainer's per-step metrics (train.output_dir=DIR)
  rollouts.dp<r>.jsonl       every step's sampled rows of DP rank r (TP rank 0): global row id, sample id, tokens
  weights/                   final weights, torch_dist (global keys: comparable across layouts)
  grads_<kind>_mb<N>/        (--grads N,M,..) gradients of a first minibatch instead of training (save_gradients)
  grads_<kind>_planned/      (--planned-grad [--planned-aux]) the same on the rollout's own micro-batch plan
  plan_rank<r>.txt           (--planned-grad, every rank) the rank's own plan of its rows next to the agreed one
  replicas.json              (--check-replicas) the largest difference of any replicated parameter and of
                             its optimizer state across data-parallel replicas (0.0 = bit-identical)

Faults of an asynchronous job, for its tests (rollout.mode=async):
  --kill-in-push V:R         global rank R (a rollout rank) SIGKILLs itself once it received the header of
                             the weight push of version V: the trainer is in the middle of streaming to it
  --silence-trainer-at S     the trainer's heartbeat stops as step S begins (a hung trainer, process alive)
  --sigterm-rollout-at S:R   global rank R (a rollout rank) sends itself SIGTERM as it begins step S
  --kill-rollout-after S:R   trainer rank 0, once step S is trained, SIGKILLs global rank R (a rollout rank)
                             and sends itself SIGTERM, as torchrun does when a rank dies: the signal is there
                             before the trainer touches the dead rank again (its next stop vote sees it)
  --hold-sigterm             the trainer's ranks block SIGTERM for their whole life: torchrun's SIGTERM after
                             a rank died never reaches them, so the trainer finds the dead rank itself
"""

import signal
import sys

if "--hold-sigterm" in sys.argv:  # before any thread exists: every thread inherits the mask
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import argparse
import contextlib
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from megatron_gspo.runtime import parallel
from megatron_gspo.rollout.layout import ROLLOUT, role_of
from megatron_gspo.rollout.worker import run_rollout_rank
from megatron_gspo.checkpoint import save_model
from megatron_gspo.config import load_job_config
from megatron_gspo.runtime.metrics import MetricAccumulator
from megatron_gspo.testing.faults import FaultInjection
from megatron_gspo.rollout.rows import micro_batch_slices
from megatron_gspo.trainer.hooks import TrainerHook
from megatron_gspo.train import DEMO_CONFIG, Trainer, configure_logging
from megatron_gspo.runtime import exit_status
from megatron_gspo.runtime.exit_status import StoppedFor


class SilenceHeartbeat(TrainerHook):
    """The trainer's heartbeat thread stops as step ``step`` begins: seen from the rollout ranks, a hung
    trainer (its process alive, its work going on)."""

    def __init__(self, step):
        self.step = step

    def at_step_start(self, trainer):
        if trainer.step + 1 == self.step and trainer.side._heartbeat is not None:
            trainer.side._heartbeat.stop()


class KillRolloutRank(TrainerHook):
    """Trainer rank 0, once step ``step`` is trained: SIGKILL the rollout rank of global rank ``rank`` (its pid
    from ``out``/rank<R>.pid) and send itself SIGTERM, in that order, as torchrun does when a rank dies."""

    def __init__(self, step, rank, out):
        self.step, self.rank, self.out = step, rank, out

    def after_step(self, trainer, metrics):
        if trainer.step == self.step and trainer.state.is_main:
            with open(os.path.join(self.out, f"rank{self.rank}.pid"), encoding="utf-8") as f:
                os.kill(int(f.read()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGTERM)


def kill_in_push(version):
    """This rollout rank dies (SIGKILL) right after receiving the header of the push of ``version``."""
    from megatron_gspo.runtime import comm

    real = comm.bridge_broadcast

    def broadcast(t, src, group, *, what):
        out = real(t, src, group, what=what)
        if what == "weight sync: header" and int(out[0]) == version:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    comm.bridge_broadcast = broadcast


def sigterm_at(step, rank):
    """This rollout rank gets SIGTERM (from itself) as its generation of ``step`` begins (the injected
    fault ``sigterm``, megatron_gspo/testing/faults.py)."""
    spec = os.environ.get("MEGATRON_GSPO_FAULTS", "")
    os.environ["MEGATRON_GSPO_FAULTS"] = ",".join(filter(None, [spec, f"sigterm@{step}:{rank}"]))


class RecordRollouts(TrainerHook):
    """Every step's sampled rows of this DP rank (TP rank 0 writes them)."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def after_rollout(self, trainer, batch):
        st = trainer.state
        if st.tp_rank != 0:
            return
        with open(os.path.join(self.out_dir, f"rollouts.dp{st.dp_rank}.jsonl"), "a") as f:
            for i in range(batch.num_rows):
                n = int(batch.seq_lengths[i])
                keep = batch.tokens[i, :n].tolist()
                f.write(json.dumps({"step": trainer.step + 1, "row": int(batch.row_ids[i]), "sample": batch.sample_ids[i],
                                    "tokens": keep, "mask": batch.mask[i, :n - 1].long().tolist(),  # the loss's targets
                                    "reward": float(batch.rewards[i]), "advantage": float(batch.advantages[i]),
                                    # the policy versions that drew the row's first and last tokens (the record's)
                                    "versions": [int(batch.version_start[i]), int(batch.version_end[i])]}) + "\n")


def _optimizer_states(trainer):
    """param -> (exp_avg, exp_avg_sq) of megatron's replicated (non-distributed) optimizer."""
    out = {}
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                s = inner.state.get(p, {})
                if "exp_avg" in s:
                    out[p] = (s["exp_avg"], s["exp_avg_sq"])
    return out


def check_replicas(trainer):
    """Max |difference| across DP replicas of every replicated tensor (params, Adam moments)."""
    st = trainer.state
    states = {} if st.use_distributed_optimizer else _optimizer_states(trainer)
    worst = {"params": 0.0, "optimizer_state": 0.0, "params_compared": 0, "states_compared": 0}
    for name, p in trainer.model.named_parameters():
        group = st.expt_dp_group if ".mlp.experts." in name else st.dp_group
        if dist.get_world_size(group) == 1:
            continue
        tensors = [("params", p.detach())]
        if p in states:
            tensors += [("optimizer_state", t) for t in states[p]]
        for kind, t in tensors:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            diff = max((x - parts[0]).abs().max().item() for x in parts)
            worst[kind] = max(worst[kind], diff)
            worst["params_compared" if kind == "params" else "states_compared"] += 1
    # every rank saw the replica groups it belongs to: combine (max of differences, sum of counts)
    diffs = torch.tensor([worst["params"], worst["optimizer_state"]], dtype=torch.float64)
    counts = torch.tensor([worst["params_compared"], worst["states_compared"]], dtype=torch.long)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    dist.all_reduce(counts)
    return {"params": diffs[0].item(), "optimizer_state": diffs[1].item(),
            "params_compared": int(counts[0]), "states_compared": int(counts[1])}


def save_gradients(trainer, out_dir, micro_batch_sizes):
    """The gradient of the first minibatch, no update, for each micro-batch size, twice:

    grads_policy_mb<N>: a sampled rollout (train.* settings), MoE aux loss off: the policy gradient;
    grads_aux_mb<N>:    a greedy rollout (every advantage 0, so the policy loss has no gradient), aux
                        loss as configured: the load-balancing gradient alone.
    Each rollout is drawn once and reused for every micro-batch size."""
    from megatron_gspo.model.gpt import unwrap
    from megatron_gspo.trainer.optim import setup_optimizer

    model, mcfg = trainer.model, trainer.cfg.model
    coeff = mcfg.moe_aux_loss_coeff
    trainer.optimizer, trainer.scheduler, trainer.step = setup_optimizer(  # the RL optimizer (and a resume's state)
        trainer.cfg, trainer.state, trainer.ddp, trainer.checkpoints, trainer.sampler, trainer.ref_model, trainer.step)
    # routing metrics compare the training forward with the old-log-prob pass micro-batch by
    # micro-batch; here the training pass is re-split on purpose (no replay: nothing else to keep)
    trainer.routing.train_pass = lambda mb: contextlib.nullcontext()
    source = trainer.source
    for kind in ("policy", "aux"):
        if kind == "aux":  # greedy: identical samples per prompt -> all advantages exactly 0
            source.row_gen_cfg = dataclasses.replace(source.row_gen_cfg, temperature=0.0)
            trainer.prepare.temperature = 1.0
        # the coefficient is read by megatron's routers at every forward and by aux_loss_scales
        unwrap(trainer.ddp).config.moe_aux_loss_coeff = mcfg.moe_aux_loss_coeff = coeff if kind == "aux" else 0.0
        trainer.routing.monitor.clear()  # the routing records of the previous rollout (no metrics here)
        batch = trainer.prepare(source.collect(trainer.step))
        trainer.hooks.after_rollout(trainer, batch)
        trainer.step += 1
        # one width for every micro-batch, agreed over the ranks (expert parallelism runs in lockstep)
        width = torch.tensor([batch.tokens.shape[1]])
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        batch.tokens = torch.nn.functional.pad(batch.tokens, (0, int(width) - batch.tokens.shape[1]))
        for name in ("mask", "sample_logprobs", "old_logprobs"):
            setattr(batch, name, torch.nn.functional.pad(getattr(batch, name), (0, int(width) - 1 - getattr(batch, name).shape[1])))
        for mbs in micro_batch_sizes:
            batch.micro = micro_batch_slices(batch.num_rows, trainer.cfg.train.num_minibatches, mbs)[0]
            batch.widths = [int(width)] * len(batch.micro)
            trainer.accumulate_gradients(batch, list(range(len(batch.micro))), MetricAccumulator())
            trainer.routing.replay.reset()
            saved = [p.detach().clone() for p in model.parameters()]
            for p in model.parameters():
                p.data.copy_(p.main_grad)
            save_model(model, os.path.join(out_dir, f"grads_{kind}_mb{mbs}"))
            for p, w in zip(model.parameters(), saved):
                p.data.copy_(w)


def save_planned_gradient(trainer, out_dir, aux=False):
    """grads_policy_planned: the first minibatch's policy gradient (the aux loss's gradient scaled by 0) with
    the micro-batch plan the rollout made itself (train.micro_batch_size / max_tokens_per_micro_batch, agreed
    over the ranks that must run the same micro-batches). Prints this rank's own plan next to the agreed one.
    ``aux``: then grads_aux_planned, a greedy rollout's (every advantage 0) first minibatch gradient with the
    aux loss as configured, on its own plan: the load-balancing gradient alone."""
    from megatron_gspo.model.gpt import set_aux_loss_scale
    from megatron_gspo.rollout.prepare import plan_micro_batches
    from megatron_gspo.trainer import loop
    from megatron_gspo.trainer.optim import setup_optimizer

    trainer.optimizer, trainer.scheduler, trainer.step = setup_optimizer(  # the RL optimizer (and a resume's state)
        trainer.cfg, trainer.state, trainer.ddp, trainer.checkpoints, trainer.sampler, trainer.ref_model, trainer.step)
    # the load-balancing loss runs as configured (the plan it needs, its collectives in aux_loss_scales and in
    # megatron's routers) but its gradient is scaled by 0: the saved gradient is the policy's alone
    loop.set_aux_loss_scale = lambda scale, device: set_aux_loss_scale(0.0, device)
    try:
        t = trainer.cfg.train
        batch = trainer.prepare(trainer.source.collect(trainer.step))
        own = plan_micro_batches(batch.seq_lengths.tolist(), t.num_minibatches, t.micro_batch_size,
                                 t.max_tokens_per_micro_batch, trainer.state.tp if trainer.state.sequence_parallel else 1)
        line = (f"[rank {trainer.state.rank}] plan: own {[len(m) for m in own[1]]} widths {own[2]}; "
                f"agreed {[len(m) for m in batch.minibatches]} widths {batch.widths}")
        print(line, flush=True)
        with open(os.path.join(out_dir, f"plan_rank{trainer.state.rank}.txt"), "w", encoding="utf-8") as f:
            f.write(line + "\n")
        trainer.accumulate_gradients(batch, batch.minibatches[0], MetricAccumulator())
    finally:  # megatron's own again (jobs.py may run another job in this process)
        loop.set_aux_loss_scale = set_aux_loss_scale
    model = trainer.model
    weights = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.data.copy_(p.main_grad)
    save_model(model, os.path.join(out_dir, "grads_policy_planned"))
    if not aux:
        return
    for p, w in zip(model.parameters(), weights):
        p.data.copy_(w)
    source = trainer.source
    source.row_gen_cfg = dataclasses.replace(source.row_gen_cfg, temperature=0.0)
    trainer.prepare.temperature = 1.0
    trainer.step += 1
    batch = trainer.prepare(source.collect(trainer.step))
    trainer.accumulate_gradients(batch, batch.minibatches[0], MetricAccumulator())
    for p in model.parameters():
        p.data.copy_(p.main_grad)
    save_model(model, os.path.join(out_dir, "grads_aux_planned"))


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--check-replicas", action="store_true")
    ap.add_argument("--grads", default="", help="comma-separated micro-batch sizes: save gradients instead of training")
    ap.add_argument("--planned-grad", action="store_true", help="save the first minibatch's gradient on the rollout's own plan")
    ap.add_argument("--planned-aux", action="store_true", help="with --planned-grad: the aux loss's gradient too")
    ap.add_argument("--kill-in-push", default="", help="V:R: global rank R dies in the weight push of version V")
    ap.add_argument("--silence-trainer-at", type=int, default=0, help="the trainer's heartbeat stops at this step")
    ap.add_argument("--sigterm-rollout-at", default="", help="S:R: global rank R gets SIGTERM as it begins step S")
    ap.add_argument("--kill-rollout-after", default="", help="S:R: trainer rank 0 kills global rank R after step S")
    ap.add_argument("--hold-sigterm", action="store_true", help="the trainer's ranks never see SIGTERM")
    a = ap.parse_args(argv[:split])
    overrides = argv[split + 1:] + [f"train.output_dir={a.out}", "train.tensorboard=false"]
    cfg = load_job_config(DEMO_CONFIG, overrides)
    os.makedirs(a.out, exist_ok=True)
    configure_logging(cfg)  # as train.main does: the trainer's and the rollout ranks' lines
    if role_of(cfg) == ROLLOUT:  # rollout.mode=async: this rank generates for the trainer's ranks
        with open(os.path.join(a.out, f"rank{os.environ['RANK']}.pid"), "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))  # for --kill-rollout-after
        if a.hold_sigterm:  # only the trainer holds it back
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if a.kill_in_push and int(a.kill_in_push.split(":")[1]) == int(os.environ["RANK"]):
            kill_in_push(int(a.kill_in_push.split(":")[0]))
        if a.sigterm_rollout_at and int(a.sigterm_rollout_at.split(":")[1]) == int(os.environ["RANK"]):
            sigterm_at(int(a.sigterm_rollout_at.split(":")[0]), int(os.environ["RANK"]))
        code = run_rollout_rank(cfg, faults=FaultInjection.from_env())
        exit_status.ignore_stop_signals()  # as megatron_gspo.train's __main__ ends a rank
        exit_status.leave(code)
    hooks = [SilenceHeartbeat(a.silence_trainer_at)] if a.silence_trainer_at else []
    if a.kill_rollout_after:
        hooks.append(KillRolloutRank(*map(int, a.kill_rollout_after.split(":")), a.out))
    faults = FaultInjection.from_env()  # MEGATRON_GSPO_FAULTS, as train.main adds it
    trainer = Trainer(cfg, hooks=[*([faults] if faults else []), RecordRollouts(a.out), *hooks])
    try:
        if a.grads:
            save_gradients(trainer, a.out, [int(x) for x in a.grads.split(",")])
            return
        if a.planned_grad:
            save_planned_gradient(trainer, a.out, aux=a.planned_aux)
            return
        try:
            trainer.run()
        except StoppedFor as e:  # preempted, too many skips, rollout ranks lost: the code, for the test
            print(f"STOPPED exit {e.exit_code}: {e}", flush=True)
            sys.exit(e.exit_code)
        if a.check_replicas:
            worst = check_replicas(trainer)
            if trainer.state.is_main:
                json.dump(worst, open(os.path.join(a.out, "replicas.json"), "w"))
            print(f"[rank {trainer.state.rank}] replicas: {worst}", flush=True)
        save_model(trainer.model, os.path.join(a.out, "weights"))
    finally:
        trainer.close()
        parallel.destroy()


if __name__ == "__main__":
    main()

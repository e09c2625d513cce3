"""One side of an asynchronous job: its own torch.distributed world, the bridge, and the control plane.

Why two worlds. megatron-core keeps one parallel layout per process and builds its groups over the
*default* world (``initialize_model_parallel``), and ``dist_checkpointing`` saves and loads with
collectives over the default world too. So each side initializes torch.distributed as a world of its
own (the trainer's ranks 0..T-1, the rollout ranks 0..R-1), on torchrun's store under a prefix of its
own: megatron's groups, checkpoints (the trainer saves without the rollout ranks, e.g. after one
died) and every collective of the package then run exactly as in a colocated job of that size.

The bridge. Two process groups built directly on the same store (ranks: the trainer's rank 0 is bridge
rank 0, rollout rank r is bridge rank 1 + r), over NCCL on GPUs and gloo on the CPU, driven through
comm.bridge_*:
    sync  the weight stream: broadcasts from bridge rank 0 (weight_sync.py)
    data  rollout batches: each rollout data-parallel leader sends its rows to bridge rank 0
The trainer's other ranks are not members: they take part in the weight sync only through the
trainer's own groups (assembling full tensors), and get batches from trainer rank 0.

The control plane (``Control``): keys in torchrun's store, read without blocking, so that neither side
ever sits in a bridge collective the other side has not announced: the version the trainer is
pushing, which rollout batches are ready, a heartbeat per rank, why a rank exited, and the stop.
"""

from __future__ import annotations

import datetime
import enum
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_gspo.rollout.layout import ROLLOUT, TRAINER, RankSplit, check_world
from megatron_gspo.config import ConfigError, JobConfig
from megatron_gspo.config.rollout import HEARTBEAT_PERIOD_S

PREFIX = "gspo/async/"


@dataclass
class Side:
    """This process's place in an asynchronous job."""

    role: str  # "trainer" | "rollout"
    global_rank: int
    split: RankSplit
    store: object  # torchrun's store (the rendezvous'), shared by both sides
    timeout: datetime.timedelta
    sync_pg: object = None  # bridge process groups (trainer rank 0 and every rollout rank), see open_bridge
    data_pg: object = None
    control: Optional["Control"] = None
    _heartbeat: Optional["Heartbeat"] = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        """Rank in this side's world."""
        return self.split.side_rank(self.global_rank)

    @property
    def size(self) -> int:
        return self.split.trainer_size if self.role == TRAINER else self.split.rollout_size

    @property
    def store_prefix(self) -> str:
        return f"{PREFIX}{self.role}/"

    @property
    def bridge_rank(self) -> Optional[int]:
        """This rank's bridge rank (None: not a member, i.e. trainer ranks > 0)."""
        if self.role == ROLLOUT:
            return 1 + self.rank
        return 0 if self.rank == 0 else None

    @property
    def on_bridge(self) -> bool:
        return self.bridge_rank is not None

    def world_store(self):
        """The store of this side's default world."""
        return dist.PrefixStore(self.store_prefix, self.store)

    def open_bridge(self, device: torch.device) -> None:
        """Build the bridge groups (members only; collective over the members) and start the heartbeat.
        Call after this side's world is initialized: the backend follows ``device``."""
        self.control = Control(self.store, self.split, self.global_rank)
        self._heartbeat = Heartbeat(self.control)
        if not self.on_bridge:
            return
        size = 1 + self.split.rollout_size
        self.sync_pg = _backend(device, dist.PrefixStore(f"{PREFIX}bridge/sync/", self.store), self.bridge_rank,
                                size, self.timeout, "gspo_bridge_sync")
        self.data_pg = _backend(device, dist.PrefixStore(f"{PREFIX}bridge/data/", self.store), self.bridge_rank,
                                size, self.timeout, "gspo_bridge_data")

    def close(self, stop: Optional[str] = None) -> None:
        """Stop the heartbeat and drop the bridge; ``stop``: trainer rank 0 tells the rollout ranks to end."""
        if stop is not None and self.role == TRAINER and self.rank == 0:
            try:  # (a trainer that failed before opening the bridge has no Control yet)
                (self.control or Control(self.store, self.split, self.global_rank)).announce_stop(stop, 0)
            except Exception:  # the store went away with the launcher: the rollout ranks go with it
                pass
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self.sync_pg = self.data_pg = None


def _backend(device: torch.device, store, rank: int, size: int, timeout: datetime.timedelta, name: str):
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.group_name = name
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def short_error(e: BaseException) -> str:
    """The first line of a c10d error without gloo's source location ("[.../pair.cc:553] ")."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return line.split(". ")[0].rstrip(".")  # gloo goes on with generic advice


# What gloo / c10d say when the other end of a connection is gone (one test each: tests/test_rollout_record.py)
PEER_LOSS_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe")


def is_peer_loss(e: BaseException) -> bool:
    """A c10d error that means a peer of the bridge is gone (its connection closed or reset, or a timeout).

    By type first (torch.distributed.DistNetworkError: a connection to a peer failed); gloo raises the rest
    as RuntimeError / DistBackendError with only the message to tell: ``peer_loss_text``."""
    network = getattr(dist, "DistNetworkError", None)
    if network is not None and isinstance(e, network):
        return True
    return isinstance(e, RuntimeError) and peer_loss_text(str(e))


def peer_loss_text(message: str) -> bool:
    """The one place a c10d message's wording is matched (PEER_LOSS_TEXTS)."""
    return any(s in message for s in PEER_LOSS_TEXTS)


def join(cfg: JobConfig, expect: Optional[str] = None) -> Side:
    """This process's side of an async job, from torchrun's environment; rendezvous on torchrun's store
    (once per process: rank 0 may host the store)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("rollout.mode=async runs under torchrun (RANK / WORLD_SIZE unset): launch "
                          f"rollout.world_size={cfg.rollout.world_size} + the trainer's ranks with torchrun or "
                          "launch/pretrain_gspo.sh")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    split = check_world(cfg, world)
    role = split.role(rank)
    if expect is not None and role != expect:
        raise RuntimeError(f"global rank {rank} is a {role} rank of this async job, not a {expect} rank")
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    return Side(role=role, global_rank=rank, split=split, store=store, timeout=timeout)


# ----------------------------------------------------------------------------------------------
# The control plane
# ----------------------------------------------------------------------------------------------


class Control:
    """Keys of the control plane in torchrun's store (every read is non-blocking: ``check`` before ``get``).

        push               the policy version the trainer streams now (value + 1; 0 = none yet)
        start              {"step", "data"}: where the rollout ranks start (a resume's data position)
        ready/<step>/<i>   rollout leader i sent its rows of that step's batch
        hb/<rank>          heartbeat counter of a global rank (a thread bumps it every second)
        exit/<rank>        why a global rank ended: {"message", "error"}
        stop               {"reason", "code"}: the trainer ended, the rollout ranks follow
        stop_request       {"rank", "signal"}: a rollout rank got a stop signal (SIGTERM to it alone, say):
                           the trainer saves and stops as if it had got it (the first request is kept)
    """

    def __init__(self, store, split: RankSplit, global_rank: int) -> None:
        self.store, self.split, self.global_rank = store, split, global_rank
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last heartbeat value, when it changed)

    def _k(self, key: str) -> str:
        return PREFIX + key

    def _has(self, key: str) -> bool:
        return self.store.check([self._k(key)])

    def _get_json(self, key: str) -> Optional[dict]:
        return json.loads(self.store.get(self._k(key)).decode()) if self._has(key) else None

    def _set_json(self, key: str, value: dict) -> None:
        self.store.set(self._k(key), json.dumps(value))

    # -- versions -------------------------------------------------------------------------------
    def announce_push(self, version: int) -> None:
        self.store.set(self._k("push"), str(version + 1))

    def pushed_version(self) -> int:
        """The version the trainer announced last (-1: none)."""
        return int(self.store.add(self._k("push"), 0)) - 1

    # -- start / stop ---------------------------------------------------------------------------
    def announce_start(self, step: int, data_state: dict) -> None:
        self._set_json("start", {"step": step, "data": data_state})

    def start(self) -> Optional[dict]:
        return self._get_json("start")

    def announce_stop(self, reason: str, code: int) -> None:
        self._set_json("stop", {"reason": reason, "code": code})

    def stopped(self) -> Optional[dict]:
        return self._get_json("stop")

    def request_stop(self, signal_name: str) -> None:
        """This (rollout) rank got a stop signal: ask the trainer to save and stop."""
        if not self._has("stop_request"):
            self._set_json("stop_request", {"rank": self.global_rank, "signal": signal_name})

    def stop_request(self) -> Optional[dict]:
        return self._get_json("stop_request")

    # -- batches ----------------------------------------------------------------------------------
    def mark_ready(self, step: int, leader: int) -> None:
        self.store.set(self._k(f"ready/{step}/{leader}"), "1")

    def ready(self, step: int, leader: int) -> bool:
        return self._has(f"ready/{step}/{leader}")

    def consumed(self, step: int, leader: int) -> None:
        self.store.delete_key(self._k(f"ready/{step}/{leader}"))

    # -- liveness ---------------------------------------------------------------------------------
    def beat(self) -> None:
        self.store.add(self._k(f"hb/{self.global_rank}"), 1)

    def record_exit(self, message: str, error: bool) -> None:
        try:
            self._set_json(f"exit/{self.global_rank}", {"message": message, "error": error})
        except Exception:  # the store may be gone with the launcher: nothing left to tell
            pass

    def exit_of(self, rank: int) -> Optional[dict]:
        return self._get_json(f"exit/{rank}")

    def silent_for(self, rank: int) -> float:
        """Seconds since global rank ``rank``'s heartbeat last moved, as seen from here (0 the first time)."""
        value = int(self.store.add(self._k(f"hb/{rank}"), 0))
        now = time.monotonic()
        last = self._seen.get(rank)
        if last is None or last[0] != value:
            self._seen[rank] = (value, now)
            return 0.0
        return now - last[1]

    def check_peers(self, ranks: list[int], timeout_s: float, what: str) -> tuple["PeerState", str]:
        """(ALIVE, "") while every global rank of ``ranks`` beats and has not exited, else the first one's
        state and what is wrong, in words."""
        for r in ranks:
            info = self.exit_of(r)
            if info is not None:
                state = PeerState.FAILED if info.get("error") else PeerState.EXITED
                return state, f"{what} rank {r} {'failed' if state is PeerState.FAILED else 'exited'}: {info.get('message', '')}"
            silent = self.silent_for(r)
            if silent > timeout_s:
                return PeerState.SILENT, (f"{what} rank {r} sent no heartbeat for {silent:.0f} s (rollout.heartbeat_timeout_s="
                                          f"{timeout_s:g}): killed, hung, or its node is gone")
        return PeerState.ALIVE, ""


class PeerState(enum.Enum):
    """A rank of the other side, as the control plane sees it: ALIVE; FAILED (it raised: a failure, exit 1);
    EXITED (it left), SILENT (no heartbeat: killed, hung, node gone): a checkpoint and a resume are the remedy."""

    ALIVE = "alive"
    FAILED = "failed"
    EXITED = "exited"
    SILENT = "silent"


class Heartbeat:
    """Bumps this rank's heartbeat key every HEARTBEAT_PERIOD_S from a daemon thread (alive = the process
    runs); rollout.heartbeat_timeout_s is at least 3 periods."""

    def __init__(self, control: Control, period_s: float = HEARTBEAT_PERIOD_S) -> None:
        self.control, self.period_s = control, period_s
        self._stop = threading.Event()
        control.beat()
        self._thread = threading.Thread(target=self._run, name="gspo-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.control.beat()
            except Exception:  # the store went away (the job is ending): stop beating
                return

    def stop(self) -> None:
        self._stop.set()

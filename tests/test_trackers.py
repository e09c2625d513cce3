"""train.loggers: the run trackers (runtime/trackers/). wandb in offline mode and MLflow on a local file store (no
network, no server) hold the scalar series of metrics.jsonl, at the same steps, across a stop and a resume; a
tracker that fails is said in one line and training goes on; a tracker named and not installed is refused at
start-up."""

import glob
import json
import logging
import math
import os
import struct

import pytest

from megatron_gspo.config import load_job_config, sections
from megatron_gspo.errors import ConfigError
from megatron_gspo.runtime.trackers import Tracker, Trackers, build_trackers, flat_config
from log_capture import LogLines

# the scalars every tracker holds: what metrics.jsonl holds, less the row's step (a run of finite values)
WANDB_OWN_KEYS = {"_step", "_runtime", "_timestamp"}


def read_wandb_offline(save_dir: str) -> list[dict]:
    """Every offline run under ``save_dir``/wandb, in the order they were written: {"id", "config" (the run
    record's, flattened keys), "history" [(step, {key: value})]}. The .wandb file is wandb's transaction log
    (a LevelDB-style log of protobuf Records: a 7-byte header, then 32 KiB blocks of records, each with a 7-byte
    header: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4); wandb 0.31 ships no reader of it in
    Python, its records are wandb.proto's."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", path
        pos, buf, run = 7, b"", {"id": None, "config": {}, "history": []}
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:  # a block's tail too short for a header is padding
                pos += left
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            pos += 7
            if kind == 0:  # zero padding to the end of the block
                pos += left - 7
                continue
            buf, pos = buf + data[pos:pos + n], pos + n
            if kind not in (1, 4):
                continue
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            what = rec.WhichOneof("record_type")
            if what == "run":
                run["id"] = rec.run.run_id
                run["config"] = {u.key: json.loads(u.value_json) for u in rec.run.config.update if u.key != "_wandb"}
            elif what == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                run["history"].append((rec.history.step.num, {k: v for k, v in row.items() if k not in WANDB_OWN_KEYS}))
        runs.append(run)
    return runs


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_the_config_names_the_trackers_there_are(tmp_path):
    every = load_job_config(None, [f"train.loggers=[{','.join(sections.TRACKER_NAMES)}]"]).train
    assert [t.name for t in build_trackers(every, str(tmp_path), {})] == list(sections.TRACKER_NAMES)  # each builds
    assert load_job_config(None, []).train.trackers == ["tensorboard"]  # the default, as before
    assert load_job_config(None, ["train.loggers=[wandb,mlflow]"]).train.trackers == ["wandb", "mlflow"]
    assert load_job_config(None, ["train.tensorboard=false"]).train.trackers == []  # the older switch still works
    with pytest.raises(ConfigError) as e:
        load_job_config(None, ["train.loggers=[tensorboard,neptune]"])
    assert str(e.value) == ("train.loggers=['tensorboard', 'neptune']: 'neptune' is not one of "
                            "['tensorboard', 'wandb', 'mlflow']")


def test_a_tracker_named_and_not_installed_stops_the_start_with_the_pip_line(tmp_path, monkeypatch):
    import importlib.util

    from jobs_in_process import TINY_JOB, run_main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    code, errors, _ = run_main(TINY_JOB + ["train.loggers=[tensorboard,mlflow]", f"train.output_dir={tmp_path}"])
    assert code == 2 and errors == ["error: train.loggers names mlflow, which is not installed here: pip install mlflow"]
    assert not os.listdir(tmp_path)  # refused before anything was written


class Recorder(Tracker):
    """A tracker that records what it gets, and raises where told to."""

    def __init__(self, name, fail_at=None, fail_start=False):
        self.name, self.fail_at, self.fail_start = name, fail_at, fail_start
        self.got, self.closed = [], 0

    def start(self, first_step):
        if self.fail_start:
            raise ConnectionError("api.wandb.ai: Name or service not known\n(and a long traceback)")

    def log(self, step, scalars, histograms):
        if step == self.fail_at:
            raise ValueError("bad key")
        self.got.append((step, dict(scalars)))

    def run(self):
        return {"id": self.name}

    def close(self):
        self.closed += 1


def test_a_failing_tracker_is_said_in_one_line_and_dropped_while_the_others_go_on(tmp_path):
    from megatron_gspo.runtime.logger import MetricsLogger

    good, bad, dead = Recorder("mlflow"), Recorder("wandb", fail_at=2), Recorder("tensorboard", fail_start=True)
    with LogLines(logging.WARNING) as said:
        m = MetricsLogger(str(tmp_path), enabled=True, trackers=[dead, bad, good])
        for step in (1, 2, 3):
            m.log(step, {"x": float(step), "nan": math.nan})
        runs = m.runs()
        m.close()
    assert said.lines == [
        "train.loggers: tensorboard failed at start-up and is off for the rest of the run (training, metrics.jsonl "
        "and the other loggers go on): ConnectionError: api.wandb.ai: Name or service not known",
        "train.loggers: wandb failed at step 2 and is off for the rest of the run (training, metrics.jsonl and the "
        "other loggers go on): ValueError: bad key"]
    assert [r["step"] for r in jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert good.got == [(1, {"x": 1.0}), (2, {"x": 2.0}), (3, {"x": 3.0})]  # non-finite: metrics.jsonl only
    assert bad.got == [(1, {"x": 1.0})]  # not tried again after it failed
    assert (dead.closed, bad.closed, good.closed) == (1, 1, 1)
    # a run that started and failed later is still continued by a resume; one that never started has none
    assert runs == {"wandb": {"id": "wandb"}, "mlflow": {"id": "mlflow"}}


def test_only_rank_0_writes_to_the_trackers(tmp_path):
    from megatron_gspo.runtime.logger import MetricsLogger

    other = Recorder("wandb")
    m = MetricsLogger(str(tmp_path), enabled=False, trackers=[other])  # a rank other than 0
    m.log(1, {"x": 1.0})
    m.close()
    assert other.got == [] and other.closed == 0 and m.runs() == {} and not os.listdir(tmp_path)


def test_mlflow_metric_names():
    from megatron_gspo.runtime.trackers.mlflow_run import is_file_store, metric_name

    assert metric_name("eval/pass@4") == "eval/pass_4" and metric_name("routing/aux_loss/layer_0") == "routing/aux_loss/layer_0"
    assert metric_name("routing/aux_loss/layer_0", file_store=True) == "routing.aux_loss.layer_0"
    assert is_file_store("file:///tmp/mlruns") and is_file_store("/tmp/mlruns") and not is_file_store("http://host:5000")


def test_flat_config_is_one_level_of_section_keys():
    job = {"train": {"num_steps": 3, "loggers": ["wandb"]}, "loss": {"name": "gspo", "settings": {}}}
    assert flat_config(job) == {"train.num_steps": 3, "train.loggers": ["wandb"], "loss.name": "gspo",
                                "loss.settings": {}}


@pytest.mark.slow
def test_wandb_and_mlflow_hold_the_metrics_of_a_10_step_job_across_a_stop_and_resume(tmp_path, monkeypatch):
    """Issue 50: a 10-step job, stopped after step 5 and resumed: wandb's offline files and MLflow's file store
    hold metrics.jsonl's scalars (same keys, steps, values) once per step; the resumed job continued the same
    runs (their ids kept in the checkpoint); the job's config was recorded once, when each run was created."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from jobs_in_process import TINY_JOB, run_main
    from megatron_gspo.runtime.trackers.mlflow_run import metric_name

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.x refuses its file store unless told
    for k in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(k, raising=False)
    out, ckpt, store = tmp_path / "out", tmp_path / "ckpt", f"file://{tmp_path}/mlruns"
    job = TINY_JOB + ["train.tensorboard=true", "train.loggers=[tensorboard,wandb,mlflow]", f"train.output_dir={out}",
                      f"checkpoint.save={ckpt}",
                      f"train.mlflow_tracking_uri={store}", "train.wandb_exp_name=tiny", "checkpoint.resume=true"]
    code, _, lines = run_main(job + ["train.num_steps=5"])
    assert code == 0, lines[-10:]
    assert not [ln for ln in lines if ln.startswith("train.loggers:")], lines
    runs = json.loads((ckpt / "iter_0000005" / "logger_runs.json").read_text())
    code, _, lines = run_main(job + ["train.num_steps=10"])
    assert code == 0, lines[-10:]
    assert not [ln for ln in lines if ln.startswith("train.loggers:")], lines
    assert json.loads((ckpt / "iter_0000010" / "logger_runs.json").read_text()) == runs

    rows = jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    series = {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in rows}
    assert all(math.isfinite(v) for s in series.values() for v in s.values())

    # wandb: one offline file per process, both of the run the checkpoint names; each step once
    first, second = read_wandb_offline(str(out))
    assert first["id"] == second["id"] == runs["wandb"]["id"]
    assert [s for s, _ in first["history"] + second["history"]] == list(range(1, 11))
    assert {s: row for s, row in first["history"] + second["history"]} == series
    assert first["config"]["train.num_steps"] == 5 and first["config"]["train.loggers"] == ["tensorboard", "wandb",
                                                                                            "mlflow"]
    assert second["config"] == {}  # recorded once: the resumed run keeps its own

    # MLflow: one run, continued; each key's history holds each step once, with metrics.jsonl's values
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(runs["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert set(run.data.metrics) == {metric_name(k, file_store=True) for k in series[1]}
    for k in series[1]:
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                          metric_name(k, file_store=True)))
        assert hist == [(s, series[s][k]) for s in range(1, 11)], k
    assert run.data.params["train.num_steps"] == "5"  # the config at the run's creation, once
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # TensorBoard: the same scalars at the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(series[1])
    assert [e.step for e in acc.Scalars("loss/loss")] == list(range(1, 11))


@pytest.mark.slow
def test_a_tracker_that_raises_during_a_job_is_said_once_and_the_job_goes_on(tmp_path, monkeypatch):
    """MLflow raising at step 2 (a server gone, a bad key): one line names it, the job trains to its end, and
    metrics.jsonl and TensorBoard hold every step."""
    pytest.importorskip("mlflow")
    from megatron_gspo.runtime.trackers.mlflow_run import MlflowTracker

    from jobs_in_process import TINY_JOB, run_main

    real_log = MlflowTracker.log

    def log(self, step, scalars, histograms):
        if step == 2:
            raise RuntimeError("API request to http://mlflow:5000 failed: Unauthorized (bad token)")
        real_log(self, step, scalars, histograms)

    monkeypatch.setattr(MlflowTracker, "log", log)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out, store = tmp_path / "out", f"file://{tmp_path}/mlruns"
    code, _, lines = run_main(TINY_JOB + ["train.tensorboard=true", "train.loggers=[tensorboard,mlflow]", "train.num_steps=3",
                                          f"train.output_dir={out}", f"train.mlflow_tracking_uri={store}"])
    assert code == 0, lines[-10:]
    assert [ln for ln in lines if ln.startswith("train.loggers:")] == [
        "train.loggers: mlflow failed at step 2 and is off for the rest of the run (training, metrics.jsonl and the "
        "other loggers go on): RuntimeError: API request to http://mlflow:5000 failed: Unauthorized (bad token)"]
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/loss")] == [1, 2, 3]

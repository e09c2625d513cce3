"""Metric reduction: local semantics, accumulation, and DP=1 == DP=2 on the same global batch."""

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_gspo.runtime.metrics import Metric, MetricAccumulator, merge_metrics, reduce_metrics

pytestmark = pytest.mark.slow  # trainer subprocesses under torchrun / the launcher

SCRIPT = os.path.join(os.path.dirname(__file__), "dist_scripts", "metrics_dp.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("metrics_dp_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_metric_kinds_local():
    x = torch.tensor([1.0, 2.0, 4.0, float("nan")])
    m = torch.tensor([True, True, True, False])  # the NaN is masked out and must not leak
    r = reduce_metrics({
        "mean": Metric.mean(x, m), "std": Metric.std(x, m), "sum": Metric.sum(x, m),
        "min": Metric.min(x, m), "max": Metric.max(x, m), "cat": Metric.cat(x, m),
        "ratio": Metric.from_sum_count(torch.tensor(3.0), 4),
    })
    assert r["mean"] == pytest.approx(7 / 3)
    assert r["std"] == pytest.approx(math.sqrt((1 + 4 + 16) / 3 - (7 / 3) ** 2))  # population std
    assert r["sum"] == 7.0 and r["min"] == 1.0 and r["max"] == 4.0 and r["ratio"] == 0.75
    assert torch.equal(r["cat"], torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))


def test_empty_metrics_read_nan():
    x, m = torch.ones(3), torch.zeros(3, dtype=torch.bool)
    r = reduce_metrics({"mean": Metric.mean(x, m), "min": Metric.min(x, m), "max": Metric.max(x, m),
                        "std": Metric.std(x, m), "cat": Metric.cat(x, m)})
    assert all(math.isnan(r[k]) for k in ("mean", "min", "max", "std"))
    assert r["cat"].numel() == 0
    assert reduce_metrics({}) == {}


def test_metric_validation():
    with pytest.raises(ValueError, match="kind 'median'"):
        Metric("median", torch.zeros(1))
    with pytest.raises(ValueError, match="needs 2 stats"):
        Metric("mean", torch.zeros(3))
    with pytest.raises(ValueError, match="cannot merge"):
        Metric.mean(torch.ones(1)).merge(Metric.max(torch.ones(1)))


def test_accumulator_equals_one_big_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, generator=g)
    mask = torch.rand(10, generator=g) > 0.3

    def metrics(v, m):
        return {"mean": Metric.mean(v, m), "std": Metric.std(v, m), "min": Metric.min(v, m),
                "max": Metric.max(v, m), "cat": Metric.cat(v, m), "n": Metric.sum(m.double())}

    whole = reduce_metrics(metrics(x, mask))
    acc = MetricAccumulator()
    for part in (slice(0, 3), slice(3, 4), slice(4, 10)):
        acc.add(metrics(x[part], mask[part]))
    assert len(acc) == 6
    parts = acc.reduce()
    for k in whole:
        torch.testing.assert_close(torch.as_tensor(parts[k]), torch.as_tensor(whole[k]), rtol=1e-12, atol=1e-12)
    # A key seen in only some micro-batches is kept.
    merged = merge_metrics({"a": Metric.sum(torch.ones(2))}, {"b": Metric.sum(torch.ones(3))})
    assert reduce_metrics(merged) == {"a": 2.0, "b": 3.0}
    acc.reset()
    assert len(acc) == 0


def test_reduce_without_init_but_with_group_raises():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this interpreter")
    with pytest.raises(ValueError, match="not initialized"):
        reduce_metrics({"a": Metric.sum(torch.ones(1))}, group=object())


@pytest.fixture(scope="module")
def dp2_result(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp2") / "result.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--out", out], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


def test_dp2_metrics_and_gradients_match_dp1(dp2_result):
    script = _load_script()
    batch = script.make_batch()
    assert dp2_result["world"] == 2
    for cfg, dp2 in zip(script.CONFIGS, dp2_result["results"]):
        theta = batch["theta"].clone().requires_grad_()
        loss, metrics = script.loss_on_rows(cfg, batch, slice(0, script.B), theta)
        loss.backward()
        dp1 = reduce_metrics(metrics)
        name = f"{cfg.name}/{cfg.loss_agg_mode}"

        assert dp1.keys() == dp2["metrics"].keys(), name
        for k, v1 in dp1.items():
            v2 = dp2["metrics"][k]
            if isinstance(v1, torch.Tensor):  # histogram values: same values, same order
                assert torch.equal(v1, v2), (name, k)
            elif k.endswith(("/min", "/max")) or k.startswith("num_"):
                assert v1 == v2, (name, k, v1, v2)
            else:
                assert v2 == pytest.approx(v1, rel=1e-12, abs=1e-15), (name, k, v1, v2)
        # The reported loss metric is the global-batch loss, and so is the sum of per-rank losses.
        assert dp1["loss"] == pytest.approx(loss.item(), rel=1e-6)
        assert dp2["loss"].item() == pytest.approx(loss.item(), rel=1e-6, abs=1e-8), name
        # Sum over ranks of the per-rank gradients == the single-process gradient.
        torch.testing.assert_close(dp2["grad"], theta.grad, rtol=1e-5, atol=1e-9, msg=name)
        # Averaging per-rank-normalized gradients would not (the ranks hold unequal amounts).
        assert not torch.allclose(dp2["naive_grad"], theta.grad, rtol=1e-3, atol=0), name


def test_dp2_histogram_has_every_sequence_in_rank_order(dp2_result):
    script = _load_script()
    hist = dp2_result["results"][0]["metrics"]["seq_ratio/hist"]
    active = int((script.make_batch()["mask"].sum(-1) > 0).sum())
    assert hist.numel() == active == 7


def test_dp2_misuse_is_reported(dp2_result):
    errors = dp2_result["errors"]
    assert "different metric names" in errors["mismatch"]
    assert "pass the data-parallel" in errors["no_group"]

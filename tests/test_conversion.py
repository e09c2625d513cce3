"""HF <-> Megatron conversion (checkpoints_tools), on CPU.

- a tiny random Qwen3-MoE written by transformers (vocab 100: padded to 128; sharded into several
  safetensors files) -> Megatron torch_dist -> loaded under TP=1, TP=2, EP=2, TP=2 x EP=2: logits
  equal transformers' (fp32, 1e-4);
- Megatron -> HF round trip: every tensor bit-identical, transformers reproduces the logits;
- checkpoints saved by megatron_gspo (perturbed weights, EP=2; plain keys with model_config.yaml,
  ``model.``-prefixed keys next to optimizer-like entries, a trainer save root) export to HF whose
  logits match the Megatron forward;
- bounded memory: a synthetic 24-layer checkpoint of ~300 MB converts both ways with a peak RSS
  growth far below its size;
- every bad input fails with its clear error before anything is written.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import types

import pytest
import torch

import conftest
from checkpoints_tools import hf_to_megatron, megatron_to_hf
from checkpoints_tools.errors import ConversionError
from checkpoints_tools.safetensors_io import SafetensorsStreamWriter

pytestmark = pytest.mark.slow  # conversions under torchrun layouts and transformers reference models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST = os.path.join(REPO, "tests", "dist_scripts")
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=256,
            rope_theta=10000.0, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False)


def torchrun(script, nproc, *args, timeout=420):
    return conftest.torchrun(script, nproc, *args, timeout=timeout)


def read_hf(d):
    from safetensors import safe_open

    idx = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.isfile(idx) else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def hf_logits(d, tokens):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(tokens).logits


def no_leftovers(out):
    """Nothing at the output path and no temp dir of ours beside it."""
    parent, base = os.path.split(os.path.abspath(out))
    stray = [n for n in os.listdir(parent) if n.startswith(f".{base}.tmp-") or n.startswith(f".{base}.old-")]
    return not os.path.exists(out) and not stray


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("conv")
    d = str(root / "hf")
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, attn_implementation="eager"))
    with torch.no_grad():  # every tensor distinct and O(1) logits (norms away from 1)
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in n else p.normal_(0, 0.15)
    m.save_pretrained(d, max_shard_size="100KB")
    n_shards = len([f for f in os.listdir(d) if f.endswith(".safetensors")])
    assert n_shards >= 3, "the tiny model should be sharded into several files"
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}, f)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    m.eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (2, 16), generator=g)
    tokens[0, -1] = 99  # the last real row of the padded vocabulary
    with torch.no_grad():
        logits = m(tokens).logits
    ref = str(root / "ref.pt")
    torch.save({"tokens": tokens, "logits": logits}, ref)
    return types.SimpleNamespace(dir=d, root=root, ref=ref, tokens=tokens, logits=logits, state=m.state_dict())


@pytest.fixture(scope="module")
def mcore(hf_model):
    out = str(hf_model.root / "mcore")
    assert hf_to_megatron.main(["--hf-dir", hf_model.dir, "--out", out, "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def layouts(mcore, hf_model):
    save = hf_model.root / "trainer"
    save.mkdir()
    p = torchrun("convert_load.py", 4, "--ckpt", mcore, "--ref", hf_model.ref, "--save-dir", str(save))
    return types.SimpleNamespace(stdout=p.stdout, save=str(save))


# ----------------------------------------------------------------------------------------------
# HF -> Megatron
# ----------------------------------------------------------------------------------------------


def test_megatron_layouts_match_transformers(layouts):
    # Parsed from the whole stream, not line by line: 4 ranks share one stdout and print() writes
    # the text and its newline separately, so two ranks' reports can land on one line.
    found = re.findall(r"\[rank (\d+)\] (\w+) \(.*?max abs diff (\S+)", layouts.stdout)
    for tag in ("tp1", "tp2", "ep2", "tp2ep2"):
        got = {int(rank): float(diff) for rank, t, diff in found if t == tag}
        assert sorted(got) == [0, 1, 2, 3], (tag, layouts.stdout)
        assert max(got.values()) <= 1e-4, (tag, got)


def test_megatron_checkpoint_layout(mcore, hf_model):
    from megatron_gspo.checkpoint import dist_checkpoint_to_tensors
    from megatron_gspo.checkpoint.torch_dist_files import read_dcp_metadata

    assert json.load(open(os.path.join(mcore, "metadata.json")))["sharded_backend"] == "torch_dist"
    assert torch.load(os.path.join(mcore, "common.pt"), weights_only=True) == {}
    for f in ("model_config.yaml", "config.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        assert os.path.isfile(os.path.join(mcore, f)), f
    md = read_dcp_metadata(mcore).state_dict_metadata
    # stacked layers, experts on their own axis, chunked per (layer, expert) like megatron's save
    fc1 = md["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (2, 4, 64, 64) and len(fc1.chunks) == 8
    # one name for the pre-MLP norm, the one both specs save (model.build_layer_spec)
    assert "decoder.layers.pre_mlp_layernorm.weight" in md
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" not in md
    assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in md
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_2.4" in md
    t = dist_checkpoint_to_tensors(mcore)
    sd = hf_model.state  # transformers' in-memory layout: fused experts
    assert t["embedding.word_embeddings.weight"].shape == (128, 64)
    assert torch.equal(t["embedding.word_embeddings.weight"][:100], sd["model.embed_tokens.weight"])
    assert not t["embedding.word_embeddings.weight"][100:].any() and not t["output_layer.weight"][100:].any()
    # fused QKV interleaved per KV group: [q_g0 (2 heads), k_g0, v_g0, q_g1, k_g1, v_g1]
    qkv = t["decoder.layers.self_attention.linear_qkv.weight"][1].reshape(2, 4, 16, 64)
    q = sd["model.layers.1.self_attn.q_proj.weight"].reshape(2, 2, 16, 64)
    assert torch.equal(qkv[:, :2], q)
    assert torch.equal(qkv[:, 2], sd["model.layers.1.self_attn.k_proj.weight"].reshape(2, 16, 64))
    assert torch.equal(qkv[:, 3], sd["model.layers.1.self_attn.v_proj.weight"].reshape(2, 16, 64))
    # fc1 = [gate; up] per expert; HF in memory fuses them as gate_up_proj [E, 2F, H]
    assert torch.equal(t["decoder.layers.mlp.experts.experts.linear_fc1.weight"][0],
                       sd["model.layers.0.mlp.experts.gate_up_proj"])
    assert torch.equal(t["decoder.layers.mlp.experts.experts.linear_fc2.weight"][1],
                       sd["model.layers.1.mlp.experts.down_proj"])
    assert torch.equal(t["decoder.layers.pre_mlp_layernorm.weight"][1],
                       sd["model.layers.1.post_attention_layernorm.weight"])


# ----------------------------------------------------------------------------------------------
# Megatron -> HF
# ----------------------------------------------------------------------------------------------


def test_roundtrip_bit_identical(mcore, hf_model, tmp_path):
    out = str(tmp_path / "hf_back")
    assert megatron_to_hf.main(["--ckpt", mcore, "--out", out, "--tokenizer-dir", hf_model.dir,
                                "--max-shard-size", "60KB", "--quiet"]) == 0
    src, got = read_hf(hf_model.dir), read_hf(out)
    assert set(src) == set(got)
    for k, v in src.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in got  # hub layout: one tensor per expert
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = set(idx["weight_map"].values())
    assert len(shards) >= 4 and all(os.path.getsize(os.path.join(out, s)) < 70_000 for s in shards)
    assert idx["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in src.values())
    for f in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json", "config.json"):
        assert os.path.isfile(os.path.join(out, f)), f
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "qwen3_moe" and cfg["vocab_size"] == 100 and cfg["norm_topk_prob"] is True
    torch.testing.assert_close(hf_logits(out, hf_model.tokens), hf_model.logits, rtol=0, atol=1e-6)


def test_export_without_hf_config_and_bf16(mcore, hf_model, tmp_path):
    """No HF config anywhere: config.json is generated from model_config.yaml alone; --dtype bf16."""
    ck = str(tmp_path / "ck")
    shutil.copytree(mcore, ck)
    os.remove(os.path.join(ck, "config.json"))
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(os.path.join(hf_model.dir, "tokenizer_config.json"), tok)
    out, out16 = str(tmp_path / "hf"), str(tmp_path / "hf16")
    assert megatron_to_hf.main(["--ckpt", ck, "--out", out, "--tokenizer-dir", str(tok), "--quiet"]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 4 and cfg["head_dim"] == 16
    torch.testing.assert_close(hf_logits(out, hf_model.tokens), hf_model.logits, rtol=0, atol=1e-6)
    assert megatron_to_hf.main(["--ckpt", ck, "--out", out16, "--tokenizer-dir", str(tok), "--quiet",
                                "--dtype", "bf16"]) == 0
    assert json.load(open(os.path.join(out16, "config.json")))["torch_dtype"] == "bfloat16"
    src, got = read_hf(hf_model.dir), read_hf(out16)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)) for k, v in src.items())


def test_export_megatron_default_local_spelling(mcore, hf_model, tmp_path):
    """A checkpoint that names the pre-MLP norm the way megatron's default local spec does
    (mlp.linear_fc1.layer_norm_weight) exports the same."""
    import dataclasses
    import pickle

    from megatron_gspo.checkpoint.torch_dist_files import read_dcp_metadata

    ck = tmp_path / "local"
    shutil.copytree(mcore, ck)
    md = read_dcp_metadata(str(ck))  # never pickle.load: the project reads .metadata restricted
    ours, theirs = "decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    md.state_dict_metadata[theirs] = md.state_dict_metadata.pop(ours)
    md.storage_data = {dataclasses.replace(k, fqn=theirs) if k.fqn == ours else k: v
                       for k, v in md.storage_data.items()}
    pickle.dump(md, open(ck / ".metadata", "wb"))
    out = str(tmp_path / "hf")
    assert megatron_to_hf.main(["--ckpt", str(ck), "--out", out, "--tokenizer-dir", hf_model.dir, "--quiet"]) == 0
    src, got = read_hf(hf_model.dir), read_hf(out)
    assert all(torch.equal(got[k], v) for k, v in src.items())


def test_single_file_hf_checkpoint(mcore, hf_model, tmp_path):
    """model.safetensors without an index converts to the same Megatron tensors."""
    from safetensors.torch import save_file

    from megatron_gspo.checkpoint import dist_checkpoint_to_tensors

    d = tmp_path / "single"
    d.mkdir()
    save_file(read_hf(hf_model.dir), str(d / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(hf_model.dir, "config.json"), d)
    hf_to_megatron.convert(str(d), str(tmp_path / "mc"), quiet=True)
    a, b = dist_checkpoint_to_tensors(mcore), dist_checkpoint_to_tensors(str(tmp_path / "mc"))
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 12 and all(torch.equal(a[k], b[k]) for k in tensors)


def test_trainer_checkpoints_export(layouts, hf_model, tmp_path):
    save = layouts.save
    ref = torch.load(os.path.join(save, "trainer_ep2_logits.pt"))
    ref_tp = torch.load(os.path.join(save, "trainer_tp2ep2_logits.pt"))
    assert (ref_tp["logits"] - ref["logits"]).abs().max().item() <= 1e-4  # same perturbed weights
    plain = os.path.join(save, "trainer_ep2_plain")
    cases = {
        "plain": [plain],  # saved under EP=2; model_config.yaml next to it, keys unprefixed
        "tp2ep2": [os.path.join(save, "trainer_tp2ep2_plain")],  # TP-split rows / vocab / [gate; up]
        "prefixed": [os.path.join(save, "trainer_ep2_prefixed"), "--hf-config",
                     os.path.join(hf_model.dir, "config.json")],  # model.* keys + optimizer.* keys
        # megatron_gspo.checkpoint.save_checkpoint's save root: its latest iter_ directory, whose
        # model config is only the job config the trainer stores in common.pt
        "save_root": [os.path.join(save, "trainer_ep2_root"), "--dtype", "fp32"],
    }
    for name, (ckpt, *extra) in cases.items():
        out = str(tmp_path / f"hf_{name}")
        assert megatron_to_hf.main(["--ckpt", ckpt, "--out", out, "--tokenizer-dir", hf_model.dir,
                                    "--quiet", *extra]) == 0, name
        logits = hf_logits(out, ref["tokens"])
        err = (logits - ref["logits"]).abs().max().item()
        assert err <= 1e-4, f"{name}: HF logits differ from the Megatron forward by {err}"
        assert (logits - hf_model.logits).abs().max().item() > 1e-2  # really the perturbed weights


# ----------------------------------------------------------------------------------------------
# bounded memory
# ----------------------------------------------------------------------------------------------


def _synthetic_hf(d, layers=24, hidden=256, experts=8, ffn=512, vocab=1000):
    """An HF Qwen3-MoE directory of random weights (~13 MB / layer), written shard by shard."""
    from checkpoints_tools.qwen3_moe import Qwen3MoeMapping

    os.makedirs(d)
    cfg_json = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": vocab,
                "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64, "num_experts": experts, "num_experts_per_tok": 2,
                "moe_intermediate_size": ffn, "intermediate_size": 2 * ffn, "norm_topk_prob": True,
                "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
                "tie_word_embeddings": False, "torch_dtype": "float32"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_json, f)
    mapping = Qwen3MoeMapping(Qwen3MoeMapping.model_config_from_hf(cfg_json))
    groups = mapping.groups()
    per = 4  # groups per shard
    chunks = [groups[i:i + per] for i in range(0, len(groups), per)]
    wmap, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for si, chunk in enumerate(chunks):
        name = f"model-{si + 1:05d}-of-{len(chunks):05d}.safetensors"
        entries = [(n, torch.float32, s) for grp in chunk for r in grp.rules for n, s in zip(r.hf_names, r.hf_shapes)]
        w = SafetensorsStreamWriter(os.path.join(d, name), entries)
        for n, _, s in entries:
            total += w.write(n, torch.randn(s, generator=g))
            wmap[n] = name
        w.close()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f)
    return total


def _run_cli(module, *args):
    p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def test_bounded_memory(tmp_path):
    hf = str(tmp_path / "hf")
    size = _synthetic_hf(hf)
    assert size > 250e6
    mc, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    _run_cli("checkpoints_tools.hf_to_megatron", "--hf-dir", hf, "--out", mc, "--summary-json", str(tmp_path / "a.json"))
    _run_cli("checkpoints_tools.megatron_to_hf", "--ckpt", mc, "--out", back, "--tokenizer-dir", hf,
             "--max-shard-size", "100MB", "--summary-json", str(tmp_path / "b.json"))
    for f in ("a.json", "b.json"):
        s = json.load(open(tmp_path / f))
        ratio = s["peak_rss_growth_bytes"] / size
        print(f"{s['direction']}: {size / 1e6:.0f} MB in {s['seconds']:.1f}s, peak RSS {s['peak_rss_bytes'] / 1e6:.0f} MB "
              f"(+{s['peak_rss_growth_bytes'] / 1e6:.0f} MB, {ratio:.3f} of the checkpoint)")
        assert ratio < 0.35, s
    # the streamed export is still right: spot-check the last layer's last expert and the head
    from safetensors import safe_open

    idx = json.load(open(os.path.join(back, "model.safetensors.index.json")))["weight_map"]
    idx_src = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["weight_map"]
    for k in ("model.layers.23.mlp.experts.7.up_proj.weight", "model.layers.23.self_attn.v_proj.weight", "lm_head.weight"):
        with safe_open(os.path.join(back, idx[k]), "pt") as a, safe_open(os.path.join(hf, idx_src[k]), "pt") as b:
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


# ----------------------------------------------------------------------------------------------
# bad inputs: a clear error, nothing written
# ----------------------------------------------------------------------------------------------


def _rewrite_config(d, **kw):
    p = os.path.join(d, "config.json")
    c = json.load(open(p))
    c.update(kw)
    json.dump(c, open(p, "w"))


def _replace_tensor(d, name, tensor):
    from safetensors.torch import load_file, save_file

    wmap = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    f = os.path.join(d, wmap[name])
    sd = load_file(f)
    sd[name] = tensor
    save_file(sd, f, metadata={"format": "pt"})


def test_hf_to_megatron_bad_inputs(hf_model, tmp_path, capsys):
    shard2 = "model-00002-of-00004.safetensors"

    def missing_shard(d):
        os.remove(os.path.join(d, shard2))

    def truncated(d):
        p = os.path.join(d, shard2)
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) - 100)

    cases = {
        "missing shard": (missing_shard, [shard2, "do not exist"]),
        "truncated file": (truncated, [shard2, "truncated"]),
        "wrong shape": (lambda d: _replace_tensor(d, "model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 48)),
                        ["model.layers.1.self_attn.o_proj.weight", "(64, 48)", "(64, 64)"]),
        "expert count": (lambda d: _rewrite_config(d, num_local_experts=8),
                         ["model.layers.0.mlp.gate.weight", "(4, 64)", "(8, 64)", "num_experts"]),
        "vocab size": (lambda d: _rewrite_config(d, vocab_size=120),
                       ["model.embed_tokens.weight", "(100, 64)", "(120, 64)", "vocab_size"]),
        "missing tensor": (lambda d: _rewrite_config(d, num_hidden_layers=3), ["missing", "model.layers.2."]),
        "unsupported config": (lambda d: _rewrite_config(d, attention_bias=True), ["attention_bias"]),
    }
    for name, (damage, words) in cases.items():
        src = str(tmp_path / f"src_{name.replace(' ', '_')}")
        shutil.copytree(hf_model.dir, src)
        damage(src)
        out = str(tmp_path / f"out_{name.replace(' ', '_')}")
        with pytest.raises(ConversionError) as e:
            hf_to_megatron.convert(src, out, quiet=True)
        for w in words:
            assert w in str(e.value), f"{name}: {w!r} not in: {e.value}"
        assert no_leftovers(out), name

    # existing output: refused without --force (and left as it was), replaced with it
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert hf_to_megatron.main(["--hf-dir", hf_model.dir, "--out", str(out), "--quiet"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert hf_to_megatron.main(["--hf-dir", hf_model.dir, "--out", str(out), "--quiet", "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / ".metadata").is_file()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".exists.")] == []
    # output inside the input is refused even with --force
    with pytest.raises(ConversionError, match="overlaps the input"):
        hf_to_megatron.convert(hf_model.dir, os.path.join(hf_model.dir, "sub"), force=True, quiet=True)


def test_megatron_to_hf_bad_inputs(mcore, hf_model, tmp_path, capsys):
    def copy(name):
        d = str(tmp_path / f"ck_{name}")
        shutil.copytree(mcore, d)
        return d

    def run(ckpt, *extra, out_name):
        out = str(tmp_path / out_name)
        with pytest.raises(ConversionError) as e:
            megatron_to_hf.convert(ckpt, out, hf_model.dir, quiet=True, **dict(extra))
        assert no_leftovers(out), out_name
        return str(e.value)

    d = copy("missing")
    os.remove(os.path.join(d, "__2_0.distcp"))
    msg = run(d, out_name="o1")
    assert "__2_0.distcp" in msg and "missing" in msg, msg

    d = copy("trunc")
    p = os.path.join(d, "__1_0.distcp")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    msg = run(d, out_name="o2")
    assert "__1_0.distcp" in msg and "truncated" in msg, msg

    d = copy("corrupt")  # right size, garbage inside: fails mid-way, still nothing left behind
    from megatron_gspo.checkpoint.torch_dist_files import read_dcp_metadata

    info = [v for k, v in read_dcp_metadata(d).storage_data.items()
            if k.fqn == "decoder.layers.self_attention.linear_qkv.weight" and v.relative_path == "__2_0.distcp"][0]
    with open(os.path.join(d, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length - 200)  # the item's zip directory
        f.write(b"\0" * 200)
    msg = run(d, out_name="o2b")
    assert "reading" in msg and "failed" in msg, msg

    hf_cfg = tmp_path / "cfg8.json"
    c = json.load(open(os.path.join(hf_model.dir, "config.json")))
    hf_cfg.write_text(json.dumps({**c, "num_local_experts": 8}))
    msg = run(mcore, ("hf_config", str(hf_cfg)), out_name="o3")
    assert "decoder.layers.mlp.router.weight" in msg and "(2, 4, 64)" in msg and "(2, 8, 64)" in msg, msg

    d = copy("vocab")
    p = os.path.join(d, "model_config.yaml")
    text = open(p).read()
    assert "vocab_size: 100" in text
    open(p, "w").write(text.replace("vocab_size: 100", "vocab_size: 300"))
    msg = run(d, out_name="o4")
    assert "embedding.word_embeddings.weight" in msg and "(128, 64)" in msg and "(384, 64)" in msg, msg

    d = copy("noconfig")
    for f in ("model_config.yaml", "config.json"):
        os.remove(os.path.join(d, f))
    msg = run(d, out_name="o5")
    assert "no model config" in msg and "--hf-config" in msg, msg

    msg = run(str(tmp_path / "nowhere"), out_name="o6")
    assert "not found" in msg, msg

    out = tmp_path / "exists"
    out.mkdir()
    assert megatron_to_hf.main(["--ckpt", mcore, "--out", str(out), "--tokenizer-dir", hf_model.dir, "--quiet"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert os.listdir(out) == []


# ----------------------------------------------------------------------------------------------
# stop signals and what killed conversions leave (issue 38)
# ----------------------------------------------------------------------------------------------

# Runs a converter with a stop signal sent to itself right after its first tensor group: the same as a
# scheduler's SIGTERM or a Ctrl-C landing mid-conversion, at a known point.
_SIGNAL_AFTER_FIRST_GROUP = """
import os, signal, sys
from checkpoints_tools import cli
real = cli.Progress.group
def group(self, *a, **k):
    real(self, *a, **k)
    if self.done == 1:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
cli.Progress.group = group
import importlib
sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))
"""


@pytest.mark.parametrize("module, sig, code", [("checkpoints_tools.hf_to_megatron", "SIGTERM", 143),
                                               ("checkpoints_tools.megatron_to_hf", "SIGINT", 130)])
def test_a_stop_signal_mid_conversion_removes_its_output_and_says_so(mcore, hf_model, tmp_path, module, sig, code):
    out = str(tmp_path / "out")
    args = (["--hf-dir", hf_model.dir] if module.endswith("hf_to_megatron")
            else ["--ckpt", mcore, "--tokenizer-dir", hf_model.dir])
    p = subprocess.run([sys.executable, "-c", _SIGNAL_AFTER_FIRST_GROUP, sig, module, *args, "--out", out],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    last = p.stderr.splitlines()[-1]
    assert re.fullmatch(rf"stopped by {sig}: removed the partial output {re.escape(str(tmp_path))}/\.out\.tmp-\w+; "
                        rf"nothing was written to --out; exit {code}", last), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and no_leftovers(out)


def _owner(path, pid):
    """What a conversion writing ``path`` records about itself (files.OWNER: runtime/owner.holder), with ``pid``."""
    import socket

    os.makedirs(path)
    with open(os.path.join(path, ".conversion-owner.json"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": pid, "pid_start": None, "slurm_job": None, "slurm_restart": 0,
                   "started": "2025-11-28 08:00:00 UTC", "command": "python -m checkpoints_tools.megatron_to_hf",
                   "token": "0" * 32}, f)


def test_leftovers_of_killed_conversions_are_named_and_removed(mcore, hf_model, tmp_path, capsys):
    """A conversion killed outright (SIGKILL, a node's end) leaves its temp dir beside --out; the next one to
    the same --out names and removes it, and leaves alone one whose conversion still runs."""
    out = str(tmp_path / "hf")
    gone = subprocess.Popen(["true"])
    gone.wait()
    _owner(str(tmp_path / ".hf.tmp-killed01"), gone.pid)
    with open(tmp_path / ".hf.tmp-killed01" / "model-00001-of-00002.safetensors", "wb") as f:
        f.write(b"\0" * 76_000)
    os.makedirs(tmp_path / ".hf.tmp-oldver01")  # an older version's: no owner recorded
    running = subprocess.Popen(["sleep", "120"])
    try:
        _owner(str(tmp_path / ".hf.tmp-running1"), running.pid)
        assert megatron_to_hf.main(["--ckpt", mcore, "--out", out, "--tokenizer-dir", hf_model.dir, "--quiet"]) == 0
    finally:
        running.kill()
        running.wait()
    said = capsys.readouterr().err.splitlines()
    assert any(s.startswith(f"[megatron->hf] removed {tmp_path}/.hf.tmp-killed01 (76.") and
               s.endswith(f"left by an earlier conversion (its process {gone.pid} is gone)") for s in said), said
    assert (f"[megatron->hf] removed {tmp_path}/.hf.tmp-oldver01 (0 B), left by an earlier conversion (killed before "
            "it recorded its owner, or written by an older version)") in said
    assert f"[megatron->hf] left {tmp_path}/.hf.tmp-running1 alone: a conversion that is still running writes it" in said
    assert sorted(os.listdir(tmp_path)) == [".hf.tmp-running1", "hf"]
    assert not os.path.exists(os.path.join(out, ".conversion-owner.json"))


def test_a_long_conversion_reports_progress_and_stops_within_seconds(tmp_path):
    """A real SIGTERM to a conversion of a ~100 MB model (8 layer groups) once its first progress line is out:
    it ends at the next tensor, not at the end of the model: no more than the group in flight reports after
    the signal (a wall-clock bound alone would measure the machine's load; on an idle one it takes < 1 s),
    exit 143, its partial output gone."""
    import time

    hf = str(tmp_path / "big")
    _synthetic_hf(hf, layers=8)
    out = str(tmp_path / "mc")
    p = subprocess.Popen([sys.executable, "-m", "checkpoints_tools.hf_to_megatron", "--hf-dir", hf, "--out", out],
                         stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines = []
    for line in p.stderr:
        lines.append(line.rstrip("\n"))
        if re.match(r"\[hf->megatron\] 1/\d+ ", line):  # the first group's progress line
            break
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    rest = p.stderr.read()
    rc = p.wait(timeout=120)
    waited = time.perf_counter() - t0
    groups_after = re.findall(r"^\[hf->megatron\] \d+/\d+ ", rest, flags=re.M)
    assert rc == 143 and len(groups_after) <= 1 and waited < 120, (rc, waited, rest[-2000:])
    assert rest.splitlines()[-1].startswith("stopped by SIGTERM: removed the partial output "), rest[-2000:]
    assert no_leftovers(out)

"""Every text file a job or a command names is read as UTF-8, and a byte that is not is one error
naming the file, the line and the column (megatron_gspo/textfile.py), never a UnicodeDecodeError
traceback: the config YAML, JSON Lines data (data.source and eval.source), a Hugging Face config.json,
the tokenizer's JSON files and chat templates, the memory estimator's recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_gspo.errors import ConfigError, DataError, TokenizerError
from megatron_gspo.textfile import read_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATIN1 = "caf\xe9".encode("latin-1")  # a latin-1 e-acute: 0xe9, then no continuation byte


def _not_utf8(path, line, column):
    return rf"{os.path.basename(path)}:{line}: not UTF-8 text \(byte 0xe9 at column {column}\)"


def test_read_text_names_line_and_column_in_characters(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("first line\nsecond \u00fc ".encode() + LATIN1 + b"\nthird\n")  # a 2-byte char before it
    with pytest.raises(ConfigError, match=_not_utf8(p, 2, 13)):
        read_text(p, ConfigError)
    p.write_bytes(b"\xef\xbb\xbfno: bom\n")  # a byte-order mark is dropped, not an error
    assert read_text(p, ConfigError) == "no: bom\n"


def test_config_yaml(tmp_path):
    from megatron_gspo.config import load_job_config

    p = tmp_path / "job.yaml"
    p.write_bytes(b"train:\n  num_steps: 3\n  output_dir: runs/" + LATIN1 + b"\n")
    with pytest.raises(ConfigError, match=_not_utf8(p, 3, 23)):
        load_job_config(str(p))
    p.write_bytes(b"train:\n  num_steps: [3\n")  # YAML's own errors still name the file
    with pytest.raises(ConfigError, match=r"(?s)job\.yaml: invalid YAML: .*in \".*job\.yaml\", line 2"):
        load_job_config(str(p))


def test_eval_source_jsonl(tmp_path):
    from megatron_gspo.config import DataConfig
    from megatron_gspo.data.prompts import build_eval_prompts
    from megatron_gspo.data.tokenizer import CharTokenizer

    p = tmp_path / "test.jsonl"
    p.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "' + LATIN1 + b'", "answer": "2"}\n')
    with pytest.raises(DataError, match=_not_utf8(p, 2, 16)):
        build_eval_prompts(DataConfig(), str(p), 2, CharTokenizer())


def test_hf_config_json(tmp_path):
    from megatron_gspo.config import model_config_from_hf

    p = tmp_path / "config.json"
    p.write_bytes(b'{"model_type": "qwen3_moe",\n "name": "' + LATIN1 + b'"}')
    with pytest.raises(ConfigError, match=_not_utf8(p, 2, 14)):
        model_config_from_hf(tmp_path)
    p.write_text('{"model_type": "qwen3_moe",')
    with pytest.raises(ConfigError, match=r"config\.json: invalid JSON"):
        model_config_from_hf(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"])
def test_hf_tokenizer_side_files(tmp_path, name):
    from test_tokenizer import _write_hf_tokenizer

    from megatron_gspo.data.tokenizer import HFTokenizer

    _write_hf_tokenizer(tmp_path)
    p = tmp_path / name
    text = p.read_bytes() if p.exists() else b"{{ messages }}"
    p.write_bytes(text[:1] + b"\n" + LATIN1 + text[1:])
    with pytest.raises(TokenizerError, match=_not_utf8(p, 2, 4)):
        HFTokenizer(tmp_path)


def test_chat_template_file(tmp_path):
    from megatron_gspo.config import TokenizerConfig
    from megatron_gspo.data.tokenizer import build_tokenizer

    p = tmp_path / "t.jinja"
    p.write_bytes(b"{% for m in messages %}" + LATIN1 + b"{% endfor %}")
    with pytest.raises(TokenizerError, match=_not_utf8(p, 1, 27)):
        build_tokenizer(TokenizerConfig(chat_template=str(p)))


def test_memory_estimate_recipe(tmp_path):
    p = tmp_path / "recipe.yaml"
    p.write_bytes(b"# world_size: 8\n# " + LATIN1 + b"\nmodel:\n  preset: tiny\n")
    r = subprocess.run([sys.executable, "launch/memory_estimate.py", str(p)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {p}:2: not UTF-8 text (byte 0xe9 at column 6)"), last


def test_a_damaged_metrics_file_does_not_stop_a_resume(tmp_path):
    from megatron_gspo.runtime.logger import truncate_jsonl

    p = tmp_path / "metrics.jsonl"
    p.write_bytes(json.dumps({"step": 1}).encode() + b"\n" + b'{"step": 2, "x": "' + LATIN1 + b'"}\n'
                  + json.dumps({"step": 3}).encode() + b"\n")
    assert truncate_jsonl(str(p), 3) == 1  # step 3 goes; the damaged byte spoils one string, not the resume
    assert [json.loads(line)["step"] for line in p.read_text(encoding="utf-8").splitlines()] == [1, 2]

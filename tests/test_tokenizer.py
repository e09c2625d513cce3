"""Tokenizers: HF tokenizer.json (+ config, chat template), SentencePiece, the built-in char table."""

from __future__ import annotations

import json
import re

import pytest

from megatron_gspo.data.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerConfig,
    TokenizerError,
    build_tokenizer,
    check_vocab_fits,
)

# The published Qwen3 chat template (Qwen/Qwen3-*-Base tokenizer_config.json), so the renderer is
# exercised on namespace(), reversed slices, str methods, tojson and the enable_thinking switch.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["what is 12+7?", "the answer is 19", "hello world", "sort 3 1 2", "You are a helpful assistant."]


def _write_hf_tokenizer(directory, eos="<|im_end|>", template=QWEN3_TEMPLATE, generation_eos=True):
    """A byte-level BPE tokenizer.json trained on a few strings, laid out like a Qwen3 checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.add_tokens(["<think>", "</think>"])  # Qwen3: added but not special (they survive skip_special_tokens)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": eos, "pad_token": "<|endoftext|>", "bos_token": None,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos:
        ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return tok


@pytest.fixture
def hf_dir(tmp_path):
    _write_hf_tokenizer(tmp_path / "qwen_like")
    return tmp_path / "qwen_like"


# ----------------------------------------------------------------------------------------------
# Hugging Face
# ----------------------------------------------------------------------------------------------


def test_hf_round_trip_and_special_ids(hf_dir):
    tok = build_tokenizer(TokenizerConfig(type="hf", path=str(hf_dir)))
    assert isinstance(tok, HFTokenizer)
    text = "<|im_start|>user\nwhat is 12+7?<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nwhat is 12+7?"
    assert tok.decode(tok.encode("<think>\nhm\n</think>"), skip_special_tokens=True) == "<think>\nhm\n</think>"
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_id == im_end and tok.eos_ids == (im_end, eot)  # config eos first, then generation_config
    assert tok.pad_id == eot
    assert tok.bos_id is None
    assert tok.vocab_size == tok.token_to_id("</think>") + 1  # max id + 1, added tokens included
    # Unknown ids (a padded model vocabulary can sample them) decode to nothing instead of failing.
    assert tok.decode(ids + [tok.vocab_size + 5]) == text


def test_hf_chat_template_qwen3(hf_dir):
    tok = HFTokenizer(hf_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is 12+7?"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nwhat is 12+7?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs) == expected
    assert tok.apply_chat_template(msgs, enable_thinking=False) == expected + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]
    # Rendered text tokenizes back exactly (the template's markers are single special tokens).
    assert tok.decode(tok.encode(expected)) == expected
    assert tok.encode(expected)[0] == tok.token_to_id("<|im_start|>")


def test_hf_chat_template_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tok = HFTokenizer(hf_dir)
    conversations = [
        [{"role": "user", "content": "hello world"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "what is 12+7?"},
         {"role": "assistant", "content": "<think>\n12+7\n</think>\n\n19"}, {"role": "user", "content": "sort 3 1 2"}],
    ]
    for msgs in conversations:
        for kwargs in ({}, {"enable_thinking": False}):
            want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
            assert tok.apply_chat_template(msgs, **kwargs) == want
            assert tok.encode(want) == list(ref.encode(want, add_special_tokens=False))


def test_hf_tokenizer_json_path_and_template_file(tmp_path, hf_dir):
    # A tokenizer.json path reads the configs beside it; chat_template.jinja wins over the config's.
    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    tok = HFTokenizer(str(hf_dir / "tokenizer.json"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    assert tok.eos_id == tok.token_to_id("<|im_end|>")


def test_hf_added_token_dict_and_no_generation_config(tmp_path):
    d = tmp_path / "tok"
    _write_hf_tokenizer(d, eos={"content": "<|endoftext|>", "special": True}, generation_eos=False)
    tok = HFTokenizer(d)
    assert tok.eos_ids == (tok.token_to_id("<|endoftext|>"),)


def test_hf_without_template_or_eos(tmp_path):
    d = tmp_path / "tok"
    _write_hf_tokenizer(d, template=None)
    tok = HFTokenizer(d)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match="<\\|nope\\|>"):
        HFTokenizer(d)


def test_hf_missing_file_names_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_tokenizer(TokenizerConfig(type="hf", path=str(missing)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.tokenizer.json"):
        HFTokenizer(tmp_path / "empty")


# ----------------------------------------------------------------------------------------------
# SentencePiece
# ----------------------------------------------------------------------------------------------


def test_sentencepiece_round_trip(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(CORPUS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=64, model_type="bpe",
        hard_vocab_limit=False, minloglevel=2,
    )
    tok = build_tokenizer(TokenizerConfig(type="sentencepiece", path=str(tmp_path / "sp.model")))
    assert isinstance(tok, SentencePieceTokenizer)
    s = "what is 12+7? the answer is 19"
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert tok.encode(s, add_special_tokens=True) == [tok.bos_id] + ids
    assert tok.eos_id == 2 and tok.bos_id == 1  # sentencepiece defaults
    assert tok.pad_id == tok.eos_id  # trained without a pad piece -> pad with eos
    assert tok.decode(ids + [tok.eos_id]) == s  # control pieces decode to nothing
    check_vocab_fits(tok, 128)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------------------------
# Built-in characters, factory, checks
# ----------------------------------------------------------------------------------------------


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    assert tok.vocab_size <= 128
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    for s in ["12+7=19", "sort 3 1 2:1 2 3", "Hello, World!\n~{}"]:
        assert tok.decode(tok.encode(s)) == s
    ids = tok.encode("12+7=", add_special_tokens=True)
    assert ids[0] == tok.bos_id and len(ids) == 6
    # Spelled-out special tokens are special tokens, as in HF tokenizers.
    assert tok.encode("19<eos>")[-1] == tok.eos_id
    assert tok.decode(tok.encode("<bos>19<eos>")) == "<bos>19<eos>"
    assert tok.decode(tok.encode("<bos>19<eos>"), skip_special_tokens=True) == "19"
    assert tok.decode([tok.encode("1")[0], 120, 127, 5000]) == "1"  # ids past the table: skipped
    with pytest.raises(TokenizerError, match="'é'"):
        tok.encode("café")


def test_build_tokenizer_errors():
    assert isinstance(build_tokenizer(TokenizerConfig()), CharTokenizer)
    with pytest.raises(ValueError, match="builtin.*hf.*sentencepiece"):
        TokenizerConfig(type="tiktoken")
    cfg = TokenizerConfig()
    cfg.type = "bpe"  # mutated after validation (e.g. by hand): the factory still refuses it by name
    with pytest.raises(ValueError, match="'bpe'"):
        build_tokenizer(cfg)
    with pytest.raises(ValueError, match="needs tokenizer.path"):
        TokenizerConfig(type="hf")


def test_builtin_with_chat_template_override(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}Q:{{ m.content }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    tok = build_tokenizer(TokenizerConfig(chat_template=str(f)))
    assert tok.apply_chat_template([{"role": "user", "content": "1+1="}]) == "Q:1+1=A:"
    with pytest.raises(TokenizerError, match="no chat template"):
        CharTokenizer().apply_chat_template([{"role": "user", "content": "x"}])


def test_check_vocab_fits():
    tok = CharTokenizer()
    check_vocab_fits(tok, 128)
    check_vocab_fits(tok, tok.vocab_size)
    with pytest.raises(ValueError, match=rf"vocab {tok.vocab_size}\).*model.vocab_size=64"):
        check_vocab_fits(tok, 64)


def test_a_chat_template_that_does_not_parse_is_refused_at_start_up_naming_its_file(tmp_path):
    """Compiled when the tokenizer is built (tokenizer.chat_template given) or the data is set up
    (data.apply_chat_template): the error names the template's file, not the first prompt's record."""
    pytest.importorskip("jinja2")
    from megatron_gspo.config import DataConfig
    from megatron_gspo.data.prompts import build_prompt_sampler

    bad = tmp_path / "broken.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}\n{% endfo %}")
    with pytest.raises(TokenizerError, match=rf"^{re.escape(str(bad))}: chat template does not parse \(line 2\)"):
        build_tokenizer(TokenizerConfig(chat_template=str(bad)))
    with pytest.raises(TokenizerError, match=r"^tokenizer.chat_template \(inline template\): chat template does not parse"):
        build_tokenizer(TokenizerConfig(chat_template="{{ messages[0].content"))
    # a checkpoint's own template: found when the data first needs it, at set-up
    d = tmp_path / "tok"
    _write_hf_tokenizer(d, template="{% if messages %}x{% endiff %}")
    tok = build_tokenizer(TokenizerConfig(type="hf", path=str(d)))  # unused so far: no error
    with pytest.raises(TokenizerError, match=rf"^{re.escape(str(d / 'tokenizer_config.json'))}: chat template does not parse"):
        build_prompt_sampler(DataConfig(apply_chat_template=True), tok, batch_size=2)
    # and a data set that needs a template the tokenizer lacks is refused there too
    with pytest.raises(TokenizerError, match="CharTokenizer has no chat template"):
        build_prompt_sampler(DataConfig(apply_chat_template=True), CharTokenizer(), batch_size=2)

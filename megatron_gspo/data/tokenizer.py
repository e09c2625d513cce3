"""Tokenizers behind one small interface: Hugging Face ``tokenizers``, SentencePiece, built-in chars.

The trainer, the rollout engine and the data pipeline only ever see :class:`Tokenizer`, so a job can
switch from the built-in character tokenizer (tiny CPU model, no download) to a Qwen3 checkpoint's
``tokenizer.json`` by changing ``tokenizer.type``/``tokenizer.path``.

Conventions shared by every implementation (they matter for RL, where the token ids of a prompt and
of a sampled response are trained on directly):

* ``encode(text)`` adds no special tokens unless ``add_special_tokens=True``. That mirrors
  ``transformers``' ``apply_chat_template(tokenize=True)``: a rendered chat template already spells
  out its own BOS/markers, and adding another BOS would shift every prompt. With
  ``add_special_tokens=True`` the tokenizer's own rule applies (HF: its post-processor, e.g. Llama's
  BOS; SentencePiece/char: prepend BOS).
* ``decode(ids)`` keeps special tokens by default, so ``decode(encode(s)) == s`` for text that spells
  them; pass ``skip_special_tokens=True`` to drop them. Ids the tokenizer does not know decode to
  nothing (what ``tokenizers`` does), because a model's padded vocabulary (``vocab_size`` rounded up
  to a multiple of 128) may sample ids no tokenizer defines, and decoding a rollout must not crash.
* ``vocab_size`` is ``max token id + 1``, i.e. the embedding rows the model needs, which
  :func:`check_vocab_fits` compares with the model's ``vocab_size``.
* ``eos_ids`` are all ids that end a generation (Qwen3's ``generation_config.json`` lists both
  ``<|im_end|>`` and ``<|endoftext|>``); ``eos_id`` is the first one.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from datetime import datetime
from typing import Any, Optional, Sequence

from megatron_gspo.config import TOKENIZER_TYPES, TokenizerConfig
from megatron_gspo.errors import TokenizerError
from megatron_gspo.textfile import read_json_object, read_text


# ----------------------------------------------------------------------------------------------
# Interface
# ----------------------------------------------------------------------------------------------


class Tokenizer(ABC):
    """What the rest of the project needs from a tokenizer (see the module docstring for conventions)."""

    #: Jinja chat template, or None when the tokenizer has none.
    chat_template: Optional[str] = None
    #: Where the template came from (a file, or tokenizer.chat_template's inline text), for errors.
    chat_template_source: Optional[str] = None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; unknown ids are skipped."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Max token id + 1: the number of embedding rows the model needs."""

    @property
    @abstractmethod
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation; the first is :attr:`eos_id`."""

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    @abstractmethod
    def pad_id(self) -> int:
        """Id used to pad batches (never trained on: masks decide what counts)."""

    @property
    def bos_id(self) -> Optional[int]:
        """Beginning-of-sequence id, or None when the tokenizer has none (Qwen3 has none)."""
        return None

    def special_tokens(self) -> dict[str, Optional[str]]:
        """Special token strings a chat template may reference (``bos_token``, ``eos_token``, ...)."""
        return {}

    def check_chat_template(self, required: bool = False) -> None:
        """Compile the chat template now, at start-up: a syntax error names the template's file rather
        than surfacing at the first prompt rendered, blamed on a data record. ``required``: refuse a
        tokenizer without a template (the data asks for one)."""
        if not self.chat_template:
            if required:
                self.apply_chat_template([])  # its error says what to do
            return
        try:
            _compile_chat_template(self.chat_template)
        except TokenizerError as e:
            raise TokenizerError(f"{self.chat_template_source or 'the chat template'}: {e}") from None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Extra keyword arguments reach the template as variables (Qwen3: ``enable_thinking=False``).
        Returns text; encode it with ``add_special_tokens=False`` (the template holds the markers).
        """
        if not self.chat_template:
            raise TokenizerError(
                f"{type(self).__name__} has no chat template; set data.apply_chat_template=false, or give "
                "one with tokenizer.chat_template=<template text or .jinja file>"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TokenizerError(f"chat messages must be a list of dicts with 'role' and 'content', got {messages!r:.200}")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens(), **kwargs},
        )


# ----------------------------------------------------------------------------------------------
# Chat templates (Jinja)
# ----------------------------------------------------------------------------------------------

_TEMPLATE_CACHE: dict[str, Any] = {}


def _compile_chat_template(template: str) -> Any:
    """Compile a template in an environment that matches ``transformers``' chat-template renderer.

    Templates from checkpoints are untrusted code, hence the sandbox. ``trim_blocks``/``lstrip_blocks``,
    a ``tojson`` that does not HTML-escape, ``raise_exception`` and a no-op ``{% generation %}`` tag
    are what published templates (Qwen3's included) rely on; any difference would change the prompt
    tokens the policy was trained with.
    """
    if template in _TEMPLATE_CACHE:
        return _TEMPLATE_CACHE[template]
    try:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerError(
            "rendering a chat template needs jinja2 (pip install jinja2); or set data.apply_chat_template=false"
        ) from None

    class GenerationTag(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for SFT loss masks in
        # transformers; for rendering it is transparent.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not parse (line {e.lineno}): {e.message}") from None
    _TEMPLATE_CACHE[template] = compiled
    return compiled


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         **variables: Any) -> str:
    """Render a Jinja chat template the way ``transformers.apply_chat_template(tokenize=False)`` does."""
    compiled = _compile_chat_template(template)  # first: it reports a missing jinja2 clearly
    import jinja2

    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerError(f"chat template failed on {len(messages)} message(s): {e}") from None


def _chat_template_arg_source(value: str) -> str:
    """Where ``tokenizer.chat_template`` = ``value`` comes from: its file, or the inline text."""
    return value if "{" not in value and os.path.isfile(value) else "tokenizer.chat_template (inline template)"


def _read_chat_template_arg(value: str) -> str:
    """``tokenizer.chat_template`` is template text, or a path to a file holding it."""
    if "{" not in value and os.path.isfile(value):
        return read_text(value, TokenizerError)
    if "{" not in value:
        raise TokenizerError(f"tokenizer.chat_template={value!r} is neither a Jinja template nor an existing file")
    return value


# ----------------------------------------------------------------------------------------------
# Hugging Face tokenizers
# ----------------------------------------------------------------------------------------------

# Used only when tokenizer_config.json is absent or names no eos: the usual end-of-turn/text tokens,
# most specific first (a chat model must stop at the end of its turn, not at end of document).
_FALLBACK_EOS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config.json stores special tokens as a string or as an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (``tokenizer.json``) loaded with the ``tokenizers`` library.

    ``path`` is a checkpoint/tokenizer directory or a ``tokenizer.json`` file. Next to it we read
    ``tokenizer_config.json`` (eos/pad/bos tokens, ``chat_template``), ``chat_template.jinja`` or
    ``chat_template.json`` (newer ``transformers`` save the template there; they win, as in
    ``transformers``) and ``generation_config.json`` (extra eos ids). Qwen3 instruct checkpoints
    therefore get eos ``<|im_end|>`` (+ ``<|endoftext|>`` from the generation config) and pad
    ``<|endoftext|>``.
    """

    def __init__(self, path: str | os.PathLike, chat_template: Optional[str] = None) -> None:
        from tokenizers import Tokenizer as _HFTok

        path = str(path)
        if os.path.isdir(path):
            directory, file = path, os.path.join(path, "tokenizer.json")
        else:
            directory, file = os.path.dirname(path) or ".", path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"HF tokenizer file not found: {file} (tokenizer.path={path!r})")
        try:
            self._tok = _HFTok.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{file}: not a valid tokenizers JSON file: {e}") from None
        self.path = file
        config = self._read_json(os.path.join(directory, "tokenizer_config.json"))
        gen_config = self._read_json(os.path.join(directory, "generation_config.json"))

        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0

        self._tokens = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos_ids: list[int] = []
        if self._tokens["eos_token"] is not None:
            eos_ids.append(self._require_id(self._tokens["eos_token"], "eos_token"))
        gen_eos = gen_config.get("eos_token_id")
        for i in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
            if int(i) not in eos_ids:
                eos_ids.append(int(i))
        if not eos_ids:
            for tok in _FALLBACK_EOS:
                if self._tok.token_to_id(tok) is not None:
                    eos_ids.append(self._tok.token_to_id(tok))
                    self._tokens["eos_token"] = tok
                    break
        if not eos_ids:
            raise TokenizerError(
                f"{file}: cannot determine the eos token: no tokenizer_config.json eos_token, no "
                f"generation_config.json eos_token_id, and none of {list(_FALLBACK_EOS)} is in the vocabulary"
            )
        if self._tokens["eos_token"] is None:
            self._tokens["eos_token"] = self._tok.id_to_token(eos_ids[0])
        self._eos_ids = tuple(eos_ids)
        # No pad token (Llama) -> pad with eos: padded positions are masked out anyway.
        self._pad_id = (self._require_id(self._tokens["pad_token"], "pad_token")
                        if self._tokens["pad_token"] is not None else self._eos_ids[0])
        self._bos_id = (self._require_id(self._tokens["bos_token"], "bos_token")
                        if self._tokens["bos_token"] is not None else None)
        if chat_template:
            self.chat_template = _read_chat_template_arg(chat_template)
            self.chat_template_source = _chat_template_arg_source(chat_template)
        else:
            self.chat_template, self.chat_template_source = self._find_chat_template(directory, config)

    @staticmethod
    def _read_json(path: str) -> dict[str, Any]:
        if not os.path.isfile(path):
            return {}
        return read_json_object(path, TokenizerError)

    def _require_id(self, token: str, what: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"{self.path}: {what}={token!r} from tokenizer_config.json is not in the vocabulary")
        return i

    @classmethod
    def _find_chat_template(cls, directory: str, config: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
        """(the checkpoint's own chat template or None, the file it came from)."""
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            return read_text(jinja_file, TokenizerError), jinja_file
        source = os.path.join(directory, "chat_template.json")
        template = cls._read_json(source).get("chat_template")
        if template is None:
            template, source = config.get("chat_template"), os.path.join(directory, "tokenizer_config.json")
        if isinstance(template, list):
            # Several named templates (e.g. "default", "tool_use"): transformers uses "default".
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return (template, source) if isinstance(template, str) and template else (None, None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos_id

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def special_tokens(self) -> dict[str, Optional[str]]:
        return dict(self._tokens)


# ----------------------------------------------------------------------------------------------
# SentencePiece
# ----------------------------------------------------------------------------------------------


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file. BOS/EOS/PAD come from the model's trainer settings.

    SentencePiece decodes control symbols (bos/eos/pad) to nothing, so ``skip_special_tokens`` makes
    no difference here.
    """

    def __init__(self, path: str | os.PathLike, chat_template: Optional[str] = None) -> None:
        import sentencepiece as spm

        path = str(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SentencePiece model not found: {path}")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model: {e}") from None
        self.path = path
        if self._sp.eos_id() < 0:
            raise TokenizerError(f"{path}: the SentencePiece model has no eos piece (trained with eos_id=-1)")
        self.chat_template = _read_chat_template_arg(chat_template) if chat_template else None
        self.chat_template_source = _chat_template_arg_source(chat_template) if chat_template else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(self._sp.EncodeAsIds(text))
        if add_special_tokens and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        n = self._sp.GetPieceSize()
        return self._sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < n])

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self._sp.eos_id(),)

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else self._sp.eos_id()

    @property
    def bos_id(self) -> Optional[int]:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    def special_tokens(self) -> dict[str, Optional[str]]:
        def piece(i: Optional[int]) -> Optional[str]:
            return self._sp.IdToPiece(i) if i is not None and i >= 0 else None

        return {"bos_token": piece(self.bos_id), "eos_token": piece(self.eos_id),
                "pad_token": piece(self.pad_id), "unk_token": piece(self._sp.unk_id())}


# ----------------------------------------------------------------------------------------------
# Built-in character tokenizer
# ----------------------------------------------------------------------------------------------


class CharTokenizer(Tokenizer):
    """One token per character over a fixed vocabulary: the tokenizer of the built-in tasks.

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, then ``\\n`` and the 95 printable ASCII characters
    (space to ``~``) in code-point order: 99 ids, within the tiny preset's ``vocab_size=128``. The
    table is fixed in code (not learned), so a checkpoint trained with it stays decodable forever.
    Text spelling a special token (``"<eos>"``) encodes to that token, like HF tokenizers. A character
    outside the table is an error: mapping it to an unknown token would silently corrupt prompts.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
    _SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    def __init__(self, chat_template: Optional[str] = None) -> None:
        self._id_to_str = list(self.SPECIALS) + list(self.CHARS)
        self._str_to_id = {s: i for i, s in enumerate(self._id_to_str)}
        self.chat_template = _read_chat_template_arg(chat_template) if chat_template else None
        self.chat_template_source = _chat_template_arg_source(chat_template) if chat_template else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_id] if add_special_tokens else []
        for part in self._SPECIAL_RE.split(text):
            if part in self._str_to_id and len(part) > 1:  # a special token spelled out
                ids.append(self._str_to_id[part])
                continue
            for ch in part:
                i = self._str_to_id.get(ch)
                if i is None:
                    raise TokenizerError(
                        f"CharTokenizer cannot encode {ch!r} (in {text[:60]!r}); it knows newline and printable ASCII"
                    )
                ids.append(i)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        n, first = len(self._id_to_str), len(self.SPECIALS)
        return "".join(self._id_to_str[i] for i in map(int, ids)
                       if 0 <= i < n and not (skip_special_tokens and i < first))

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_str)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self._str_to_id["<eos>"],)

    @property
    def pad_id(self) -> int:
        return self._str_to_id["<pad>"]

    @property
    def bos_id(self) -> int:
        return self._str_to_id["<bos>"]

    def special_tokens(self) -> dict[str, Optional[str]]:
        return {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": None}


# ----------------------------------------------------------------------------------------------
# Factory and checks
# ----------------------------------------------------------------------------------------------


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """Build the tokenizer a ``tokenizer:`` config section describes."""
    if cfg.type not in TOKENIZER_TYPES:  # cfg may have been mutated after construction
        raise TokenizerError(f"tokenizer.type={cfg.type!r} is not one of {list(TOKENIZER_TYPES)}")
    if cfg.type == "builtin":
        tok: Tokenizer = CharTokenizer(chat_template=cfg.chat_template)
    else:
        if not cfg.path:
            raise TokenizerError(f"tokenizer.type={cfg.type!r} needs tokenizer.path")
        if not os.path.exists(cfg.path):
            raise FileNotFoundError(f"tokenizer.path={cfg.path!r} does not exist")
        tok = (HFTokenizer(cfg.path, chat_template=cfg.chat_template) if cfg.type == "hf"
               else SentencePieceTokenizer(cfg.path, chat_template=cfg.chat_template))
    if cfg.chat_template:  # asked for by name: it must parse whether or not the data applies it
        tok.check_chat_template()
    return tok


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Fail early when the tokenizer can emit ids the model has no embedding row for.

    A model vocabulary larger than the tokenizer's is normal (Qwen3: 151,669 tokenizer ids, 151,936
    rows); the reverse would index out of the embedding table on the first prompt.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"the tokenizer ({type(tokenizer).__name__}) uses ids up to {tokenizer.vocab_size - 1} "
            f"(vocab {tokenizer.vocab_size}) but model.vocab_size={model_vocab_size}; use a model with "
            f"vocab_size >= {tokenizer.vocab_size} or a smaller tokenizer"
        )

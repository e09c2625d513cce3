"""How a conversation's turns become token ids, once each: the first prompt, the observations, a demonstration.

A multi-turn row is built from token ids only (rollout/multiturn.py): the prompt's ids, then per turn
the ids the policy sampled, then the ids of what the environment said back, appended once. The
conversation is never rendered again as a whole, so nothing the template does to history (Qwen3's drops
the ``<think>`` block of every assistant turn before the last user query) can change a token the policy
sampled, and no token at a turn boundary is lost or doubled.

``TemplateFormat`` (``data.apply_chat_template=true``): the tokenizer's chat template renders each piece.
The prompt is the first user message with ``tools=[...]`` (Qwen3 lists them in its system prompt). An
observation is the template's own text between an assistant turn's content and the next generation
prompt: rendered as ``[user, assistant <PLACEHOLDER>, observation...]`` with ``add_generation_prompt``
and cut after the placeholder; the end-of-turn token the policy already sampled (``<|im_end|>``) is
taken off its front, so for Qwen3 a tool result is exactly::

    \\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

(the ``\\n`` after the sampled ``<|im_end|>`` included; ``enable_thinking=false`` appends the empty think
block of its generation prompt, as in the first prompt).

``PlainFormat`` (no chat template: the built-in character tokenizer): the prompt is the first message's
text, an observation ``<tool>{result}</tool>`` (a tool's) or ``<user>{text}</user>`` (an environment's
feedback) after the sampled stop token.

Both give ``assistant_ids`` for demonstrations (the SFT warm start on trajectories): the content's ids
and the stop token, what the policy samples for that turn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from megatron_gspo.errors import EnvError

# Stands for an assistant turn's content while an observation is rendered; never tokenized.
_PLACEHOLDER = "\x00assistant-turn\x00"


class ChatFormat(ABC):
    """Token ids of a conversation's pieces (module doc). ``tool_format``: how the policy writes tool calls."""

    tool_format: str = "plain"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stop_id = tokenizer.eos_id

    @abstractmethod
    def prompt_ids(self, message: str, tools: Optional[list] = None) -> list[int]:
        """The first prompt: ``message`` as the user's, with the tools' schemas where the format shows them."""

    @abstractmethod
    def observation_ids(self, messages: list[dict], after: Optional[int]) -> list[int]:
        """The ids appended after an assistant turn for ``messages`` ([{"role": "tool" | "user", "content"}]);
        ``after``: the token that ended the sampled turn (a stop token), or None."""

    def assistant_ids(self, content: str) -> list[int]:
        """An assistant turn as the policy samples it: the content's ids, then the stop token."""
        return self.tokenizer.encode(content, add_special_tokens=False) + [self.stop_id]


class TemplateFormat(ChatFormat):
    """The tokenizer's chat template (module doc); ``kwargs``: data.chat_template_kwargs."""

    tool_format = "qwen3"

    def __init__(self, tokenizer, kwargs: Optional[dict] = None) -> None:
        super().__init__(tokenizer)
        self.kwargs = dict(kwargs or {})
        tokenizer.check_chat_template(required=True)

    def render(self, messages: list[dict], tools: Optional[list] = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **self.kwargs, **extra)

    def prompt_ids(self, message: str, tools: Optional[list] = None) -> list[int]:
        return self.tokenizer.encode(self.render([{"role": "user", "content": message}], tools), add_special_tokens=False)

    def observation_text(self, messages: list[dict], after: Optional[int]) -> str:
        """The template's text between an assistant turn's content and the next generation prompt's end, less
        the end-of-turn token ``after`` the policy sampled."""
        text = self.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _PLACEHOLDER}, *messages])
        at = text.find(_PLACEHOLDER)
        if at < 0:
            raise EnvError(f"the chat template ({self.tokenizer.chat_template_source or 'the tokenizer'}) does not "
                           "write an assistant message's content as it is; observations cannot be appended to the "
                           "sampled tokens")
        rest = text[at + len(_PLACEHOLDER):]
        end = self.tokenizer.decode([after]) if after is not None else ""
        return rest[len(end):] if end and rest.startswith(end) else rest

    def observation_ids(self, messages: list[dict], after: Optional[int]) -> list[int]:
        return self.tokenizer.encode(self.observation_text(messages, after), add_special_tokens=False)


class PlainFormat(ChatFormat):
    """No chat template (module doc); ``add_special_tokens``: data.add_special_tokens, for the prompt."""

    tool_format = "plain"

    def __init__(self, tokenizer, add_special_tokens: bool = True) -> None:
        super().__init__(tokenizer)
        self.add_special_tokens = add_special_tokens

    def prompt_ids(self, message: str, tools: Optional[list] = None) -> list[int]:
        return self.tokenizer.encode(message, add_special_tokens=self.add_special_tokens)

    @staticmethod
    def observation_text(messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)

    def observation_ids(self, messages: list[dict], after: Optional[int]) -> list[int]:
        return self.tokenizer.encode(self.observation_text(messages), add_special_tokens=False)


def build_format(tokenizer, data_cfg, tool_format: str = "auto") -> ChatFormat:
    """The conversation format of a job: the chat template when data.apply_chat_template, else plain;
    ``tool_format`` (env.tool_format) overrides how tool calls are written ("auto": the format's own)."""
    fmt: ChatFormat = (TemplateFormat(tokenizer, data_cfg.chat_template_kwargs) if data_cfg.apply_chat_template
                       else PlainFormat(tokenizer, data_cfg.add_special_tokens))
    if tool_format != "auto":
        fmt.tool_format = tool_format
    return fmt


def conversation_ids(fmt: ChatFormat, messages: list[dict], tools: Optional[list] = None) -> tuple[list[int], list[int]]:
    """A demonstration as the rollout would have built it: (ids, loss mask), the mask 1 on the assistant turns.

    messages: a user message (the prompt), then assistant turns, each but the last followed by tool or user
    messages (the observations). Tokenized piece by piece exactly as rollout/multiturn.py builds a row, so
    the warm start learns the very stream the policy samples (EnvError for any other shape)."""
    if not messages or messages[0].get("role") != "user":
        raise EnvError("a demonstration starts with the user's message (the prompt), got "
                       f"{messages[0].get('role') if messages else 'no message'!r}")
    ids = fmt.prompt_ids(messages[0]["content"], tools)
    mask = [0] * len(ids)
    pending: list[dict] = []
    last: Optional[int] = None
    for m in messages[1:]:
        role = m.get("role")
        if role == "assistant":
            if pending or last is not None:
                if not pending:
                    raise EnvError("a demonstration has two assistant turns in a row; an observation (tool or user) "
                                   "comes between them")
                obs = fmt.observation_ids(pending, last)
                ids, mask, pending = ids + obs, mask + [0] * len(obs), []
            turn = fmt.assistant_ids(m["content"])
            ids, mask, last = ids + turn, mask + [1] * len(turn), turn[-1]
        elif role in ("tool", "user"):
            if last is None:
                raise EnvError(f"a demonstration's {role} message comes before any assistant turn")
            pending.append({"role": role, "content": m["content"]})
        else:
            raise EnvError(f"a demonstration's messages are user, assistant and tool turns, got role {role!r}")
    if pending or last is None:
        raise EnvError("a demonstration ends with an assistant turn (what the policy says last)")
    return ids, mask

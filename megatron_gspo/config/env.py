"""The ``env`` section: multi-turn, tool-using rollouts (megatron_gspo/env/, rollout/multiturn.py). Its checks
across sections are config/rules.py's (``env_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gspo.config.checks import check
from megatron_gspo.config.fields import Resume, knob, validate

TOOL_ERROR_POLICIES = ("observation", "end")
ENV_TOOL_FORMATS = ("auto", "qwen3", "plain")
TOOLS_ENV = "tools"


@dataclass
class EnvConfig:
    """An environment the policy talks to over several turns; without one (the default) a rollout is one
    response per prompt (docs/agents.md)."""

    # The environment: null (none: single-turn rollouts), "tools" (the tool environment: the calls it finds in
    # a response run, their results are the next turn; set by env.tools alone too) or "package.module:Class" /
    # "path/to/file.py:Class" (reset(example) -> first message, step(response) -> (observation, reward, done);
    # built with env.kwargs).
    name: Optional[str] = knob(None, resume=Resume.REFUSED)
    # Tools of the tool environment: built-in names (calculator), "package.module:function" or
    # "path/to/file.py:function"; each one's JSON schema comes from its signature and docstring (env/tools.py).
    tools: list[str] = knob(default_factory=list, resume=Resume.REFUSED)
    # Keyword arguments of env.name's class (one object per row).
    kwargs: dict = knob(default_factory=dict, resume=Resume.REFUSED)
    # Assistant turns per row at most; a row still talking then ends (rollout/max_turns_reached_frac).
    max_turns: int = knob(4, resume=Resume.REFUSED, ge=1)
    # Tokens of one observation's content at most (a longer tool result or feedback is cut to it).
    max_observation_tokens: int = knob(256, resume=Resume.REFUSED, ge=1)
    # Tokens after the prompt at most (sampled + observations), a row's budget; a turn samples at most what
    # is left, an observation that does not fit ends the row. null: what the model's positions leave after
    # data.max_prompt_length. At least generation.max_new_tokens.
    max_response_tokens: Optional[int] = knob(None, resume=Resume.REFUSED, ge=1)
    # Seconds one tool call (or one environment reset / step) may take in its worker process; past it the
    # process is killed and the call answered with an error.
    tool_timeout_s: float = knob(30.0, resume=Resume.MAY_CHANGE, gt=0)
    # A tool call that raises, times out or cannot be read: "observation" (the model reads the error message as
    # the tool's result and goes on) or "end" (the row ends there). Counted either way (rollout/tool_errors). A
    # setting of the tool environment, as env.tool_format: refused with an environment class.
    on_tool_error: str = knob("observation", resume=Resume.REFUSED, choices=TOOL_ERROR_POLICIES)
    # The share of a step's rows that may end on an environment error (its step raised, timed out, returned a bad
    # reward, or said what the tokenizer cannot encode) before the job stops (EnvError, exit 2): each error ends its
    # row (rollout/env_error_frac, the first of each kind in the log), but most rows failing is a broken environment.
    max_error_frac: float = knob(0.5, resume=Resume.MAY_CHANGE, ge=0, le=1)
    # Worker processes that run the tool calls and environments of a rank's rows side by side.
    num_workers: int = knob(4, resume=Resume.MAY_CHANGE, ge=1)
    # How the policy writes a tool call: "qwen3" (<tool_call>{"name": ..., "arguments": {...}}</tool_call>),
    # "plain" (<call>NAME ARGUMENTS</call>) or "auto" (qwen3 with data.apply_chat_template, else plain). qwen3
    # needs data.apply_chat_template.
    tool_format: str = knob("auto", resume=Resume.REFUSED, choices=ENV_TOOL_FORMATS)
    # Demonstrations for the supervised warm start (train.sft_steps): a .jsonl file of {"messages": [...]}
    # conversations (user, assistant, tool / user turns); the loss is on the assistant turns, tokenized as the
    # rollout tokenizes them. null: the warm start learns the reference answers, one turn. A relative path in a YAML
    # file is read from the YAML's directory (config/job.py), on the command line from the working directory.
    sft_source: Optional[str] = knob(None, resume=Resume.MAY_CHANGE_AFTER_WARM_START)

    def __post_init__(self) -> None:
        validate(self, "env")
        if self.tools and self.name is None:
            self.name = TOOLS_ENV
        check(self.name is None or self.name == TOOLS_ENV or ":" in self.name,
              f"env.name={self.name!r} is neither 'tools' nor 'package.module:Class' or 'path/to/file.py:Class'")
        check(self.name != TOOLS_ENV or bool(self.tools),
              "env.name=tools needs env.tools: the tools the policy may call (e.g. [calculator])")
        check(not (self.tools and self.name != TOOLS_ENV),
              f"env.tools={self.tools!r} belong to the tool environment (env.name=tools), but env.name={self.name!r}: "
              "an environment class runs its own tools")
        check(not self.kwargs or (self.name is not None and self.name != TOOLS_ENV),
              "env.kwargs are the keyword arguments of env.name's class; the tool environment takes none")
        for key, default in (("tool_format", "auto"), ("on_tool_error", "observation")):
            check(getattr(self, key) == default or self.name in (None, TOOLS_ENV),
                  f"env.{key}={getattr(self, key)!r} is a setting of the tool environment (env.tools), but env.name="
                  f"{self.name!r} is a class, which parses and answers its own tool calls: leave env.{key} unset")

    @property
    def enabled(self) -> bool:
        return self.name is not None

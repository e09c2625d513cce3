"""Multi-turn, tool-using rollouts: the interface users write against (docs/agents.md).

    tools.py       tools: plain functions named module:function, their JSON schema from signature and docstring
    calculator.py  the built-in tool ``calculator`` (simpleeval: never eval)
    calls.py       tool calls in a response: Qwen3's <tool_call>{...}</tool_call>, or the plain <call>NAME ARGS</call>
    protocol.py    the environment protocol (reset / step), the tool environment and the environment classes' runner
    chat.py        a conversation's pieces as token ids, once each: the chat template's, or a plain format
    pool.py        the worker processes that run tools and environments (runtime/workers.py's pool)
    worker.py      what a worker does: the handler that runs tools and environments, a result's byte limit
    games.py       a multi-turn environment that is not a tool: an answer guessed over turns, with feedback

The turns themselves run in rollout/multiturn.py, over the job's Generator. Nothing here imports torch:
a worker process starts in a fraction of a second.
"""

from megatron_gspo import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Tool": "tools", "load_tool": "tools", "load_tools": "tools", "BUILTIN_TOOLS": "tools",
    "ToolCall": "calls", "parse_tool_calls": "calls", "format_call": "calls", "TOOL_FORMATS": "calls",
    "StepResult": "protocol", "ToolRunner": "protocol", "ClassRunner": "protocol", "build_runner": "protocol",
    "ChatFormat": "chat", "TemplateFormat": "chat", "PlainFormat": "chat", "build_format": "chat",
    "WorkerPool": "pool",
})

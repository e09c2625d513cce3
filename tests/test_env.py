"""The interface users write against (megatron_gspo/env/): tools and their schemas, the calculator, tool-call
parsing, the worker pool (errors, timeouts, stop signals, side by side), environments, chat formats (the
built-in tokenizer's plain one and Qwen3's real template: token in, token out, the <think> rewrite avoided)."""

import json
import os
import threading
import time

import pytest

from megatron_gspo.env.calls import format_call, parse_tool_calls
from megatron_gspo.env.chat import PlainFormat, TemplateFormat, conversation_ids
from megatron_gspo.env.pool import WorkerPool
from megatron_gspo.env.protocol import ClassRunner, ToolRunner, check_step
from megatron_gspo.env.tools import load_tool, load_tools
from megatron_gspo.errors import EnvError
from megatron_gspo.runtime.stop import Cancelled

HERE = os.path.dirname(os.path.abspath(__file__))

import simpleeval  # noqa: E402,F401  (install_requires: missing, it is an error, never a skip)


@pytest.fixture
def pool():
    p = WorkerPool(4)
    yield p
    p.close()


# ----------------------------------------------------------------------------------------------
# Tools
# ----------------------------------------------------------------------------------------------


def test_a_tool_schema_comes_from_its_signature_and_docstring():
    tool = load_tool("multiturn_envs:add")
    assert tool.schema() == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "description": "the first"},
                                      "b": {"type": "integer", "description": "the second, 0 when left out"}},
                       "required": ["a"]}}}
    assert load_tool("calculator").path == "megatron_gspo.env.calculator:calculator"


def test_bad_tool_names_are_refused_by_name():
    with pytest.raises(EnvError, match="neither a built-in tool"):
        load_tool("no_colon")
    with pytest.raises(EnvError, match="No module named 'nowhere_at_all'"):
        load_tool("nowhere_at_all:f")
    with pytest.raises(EnvError, match="has no 'missing'"):
        load_tool("multiturn_envs:missing")
    with pytest.raises(EnvError, match="'multiturn_envs:Echo' is a type, not a function"):
        load_tool("multiturn_envs:Echo")
    with pytest.raises(EnvError, match="both named 'add'"):
        load_tools(["multiturn_envs:add", "multiturn_envs:add"])


def test_the_calculator_computes_and_never_evaluates_code():
    from megatron_gspo.env.calculator import calculator

    assert calculator("123*456") == "56088" and calculator("(7+5)/3") == "4" and calculator("7/2") == "3.5"
    assert calculator("max(3, 9) - abs(-2)") == "7"
    for bad in ("__import__('os').getcwd()", "open('/etc/passwd')", "(1).__class__", "x + 1", "[i for i in (1, 2)]"):
        with pytest.raises(Exception):
            calculator(bad)
    with pytest.raises(Exception):  # simpleeval's power limit: no 10-million-digit integer
        calculator("9**99999999")


# ----------------------------------------------------------------------------------------------
# Tool calls
# ----------------------------------------------------------------------------------------------


def test_qwen3_tool_calls_are_parsed_and_written_back_identically():
    text = format_call("calculator", {"expression": "12*3"}, "qwen3")
    assert text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>'
    two = "<think>\nx\n</think>\n\n" + text + "\n" + format_call("add", {"a": 1, "b": 2}, "qwen3")
    calls = parse_tool_calls(two, "qwen3")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "12*3"}, None),
                                                               ("add", {"a": 1, "b": 2}, None)]
    # arguments as a JSON string (some models write them so) are read too
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "qwen3")[0].arguments == {"a": 1}


def test_malformed_tool_calls_are_errors_not_exceptions():
    def err(text, fmt="qwen3"):
        (call,) = parse_tool_calls(text, fmt)
        return call.error

    assert "is never closed" in err('<tool_call>{"name": "add"')
    assert "not valid JSON" in err("<tool_call>{name: add}</tool_call>")
    assert "names no tool" in err('<tool_call>{"arguments": {}}</tool_call>')
    assert "not a JSON object" in err('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert "names no tool" in err("<call> </call>", "plain")
    assert parse_tool_calls("no call here", "qwen3") == []


# The pieces sampled text is made of in the fuzz below: tags (whole and cut), JSON's punctuation and words, digits,
# whitespace, escapes (a lone surrogate among them), characters outside ASCII.
_FUZZ_PIECES = ["<tool_call>", "</tool_call>", "<call>", "</call>", "<tool_", "call>", "{", "}", "[", "]", '"', ":", ",",
                '"name"', '"arguments"', '"calculator"', '"add"', "calculator ", "add ", "nap ", "true", "null", "NaN",
                "-", "1e999", "9" * 50, "0.5", " ", "\n", "\\", "\\ud800", "\\u00e9", "é", "\u2028", "\x00", "\ud83d"]


def _adversarial_texts():
    """Texts a policy may sample that once broke the parser or what comes after it (issue 47, row B)."""
    deep = "[" * 3000
    return [f"<call>calculator {'9' * 5000}</call>", f"<call>add {{\"a\": {'9' * 5000}}}</call>",
            f"<tool_call>{{\"name\": \"add\", \"arguments\": {{\"a\": {'9' * 5000}}}}}</tool_call>",
            f"<call>calculator {deep}</call>", f"<call>add {deep}</call>", f"<tool_call>{deep}</tool_call>",
            f"<tool_call>{{\"name\": \"add\", \"arguments\": {{\"a\": {'[' * 200}{']' * 200}}}}}</tool_call>",
            '<tool_call>{"name": "add", "arguments": {"a": "\\ud800"}}</tool_call>',
            '<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>', "<call>add\ud800 1</call>",
            '<tool_call>{"name": "add", "arguments": "' + "[" * 3000 + '"}</tool_call>',
            "<tool_call>" * 1000, "</call><call>" * 1000, "<call>" + "x" * 100_000 + "</call>"]


def test_no_sampled_text_makes_the_tool_call_parser_raise():
    """A fuzz (a seeded generator: the same 4,000 texts each run) of random and adversarial sampled text, both
    formats: parse_tool_calls never raises, and what it returns crosses the worker pipe and the dump (JSON in UTF-8,
    no deeper than MAX_DEPTH)."""
    import random

    from megatron_gspo.env import calls as parser

    rng = random.Random(47)
    texts = _adversarial_texts() + ["".join(rng.choice(_FUZZ_PIECES) for _ in range(rng.randint(1, 60)))
                                    for _ in range(4000)]
    single = {"calculator": ("expression", "string"), "add": None, "nap": ("seconds", "number")}
    n_errors = n_calls = 0
    for text in texts:
        for fmt in ("qwen3", "plain"):
            for call in parse_tool_calls(text, fmt, single):
                n_calls += 1
                assert call.error is not None or (isinstance(call.name, str) and isinstance(call.arguments, dict))
                n_errors += call.error is not None
                json.dumps({"name": call.name, "arguments": call.arguments, "error": call.error},
                           ensure_ascii=False).encode("utf-8")
                assert not parser._depth_over(call.arguments, parser.MAX_DEPTH)
    assert n_calls > 4000 and 0 < n_errors < n_calls  # the fuzz reaches both outcomes
    # each adversarial text is a malformed call, or a call whose argument is its text as it is (one parameter)
    (big,) = parse_tool_calls(texts[0], "plain", single)
    assert big.arguments == {"expression": "9" * 5000} and big.error is None  # the calculator answers it: an error
    for text, fmt, says in ((texts[1], "plain", "not valid JSON (Exceeds the limit (4300 digits)"),
                            (texts[2], "qwen3", "not valid JSON (Exceeds the limit (4300 digits)"),
                            (texts[4], "plain", "not valid JSON (nested too deep to read)"),
                            (texts[5], "qwen3", "not valid JSON (nested too deep to read)"),
                            (texts[6], "qwen3", f"JSON nested deeper than {parser.MAX_DEPTH} levels"),
                            (texts[7], "qwen3", "cannot be sent as UTF-8"), (texts[8], "qwen3", "cannot be sent as UTF-8"),
                            (texts[9], "plain", "cannot be sent as UTF-8")):
        (call,) = parse_tool_calls(text, fmt, single)
        assert says in call.error, (text[:60], call.error)


def test_the_plain_format_writes_a_one_parameter_tool_bare():
    text = format_call("calculator", {"expression": "6*7"}, "plain", single="expression")
    assert text == "<call>calculator 6*7</call>"
    (call,) = parse_tool_calls(text + "<eos>", "plain", {"calculator": ("expression", "string")})
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "6*7"}, None)
    (call,) = parse_tool_calls('<call>add {"a": 2, "b": 3}</call>', "plain", {"add": None})
    assert call.arguments == {"a": 2, "b": 3}
    assert parse_tool_calls("<call>nap 1.5</call>", "plain", {"nap": ("seconds", "number")})[0].arguments == {"seconds": 1.5}


# ----------------------------------------------------------------------------------------------
# The worker pool and the tool environment
# ----------------------------------------------------------------------------------------------


def test_a_tool_that_raises_hangs_crashes_or_is_malformed_is_answered_and_counted(pool):
    tools = load_tools(["calculator", "multiturn_envs:nap", "multiturn_envs:boom", "multiturn_envs:crash"])
    runner = ToolRunner(tools, pool, "plain", timeout_s=1.5)
    t0 = time.perf_counter()
    results = runner.step(["<call>calculator 6*7</call>", "<call>boom</call>", "<call>nap 30</call>",
                           "<call>crash</call>", "<call>calculator 6*7", "<call>nope 1</call>", "the answer is 42"],
                          list(range(7)))
    took = time.perf_counter() - t0
    assert results[0].observation == [{"role": "tool", "content": "42"}] and results[0].tool_errors == 0
    assert results[1].observation[0]["content"] == "error: the tool 'boom' failed: ValueError: no luck"
    assert results[1].tool_calls[0]["where"].endswith("multiturn_envs.py:" + str(_line_of("raise ValueError")))
    assert results[2].observation[0]["content"] == ("error: the tool 'nap' did not answer within 1.5 s "
                                                    "(env.tool_timeout_s)")
    assert "the environment worker process exited (status 3)" in results[3].observation[0]["content"]
    assert results[4].observation[0]["content"] == "error: <call> is never closed by </call>"
    assert results[5].observation[0]["content"].startswith("error: there is no tool 'nope'; the tools are calculator")
    assert [r.tool_errors for r in results] == [0, 1, 1, 1, 1, 1, 0] and not any(r.done for r in results[:6])
    assert results[6].done and results[6].observation is None and results[6].tool_calls == []
    assert took < 1.5 + 10, took  # the hang cost its timeout once, the others ran beside it
    # the pool goes on after a kill and a crash
    assert runner.step(["<call>calculator 1+1</call>"], [0])[0].observation[0]["content"] == "2"
    # env.on_tool_error=end: a failed call ends the row instead
    ender = ToolRunner(tools, pool, "plain", timeout_s=1.5, end_on_error=True)
    (r,) = ender.step(["<call>boom</call>"], [0])
    assert r.done and r.observation is None and r.tool_errors == 1


def _line_of(text: str) -> int:
    lines = open(os.path.join(HERE, "multiturn_envs.py")).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_tool_calls_of_many_rows_run_side_by_side(pool):
    runner = ToolRunner(load_tools(["multiturn_envs:nap"]), pool, "plain", timeout_s=30)
    runner.step(["<call>nap 0</call>"] * 4, list(range(4)))  # the workers are started
    t0 = time.perf_counter()
    results = runner.step(["<call>nap 1</call>"] * 4, list(range(4)))
    took = time.perf_counter() - t0
    assert all(r.observation[0]["content"] == "slept 1.0" for r in results)
    print(f"4 rows x a 1 s tool call on 4 workers: {took:.2f} s")
    assert took < 3.5, took  # 4 s one after the other


def test_a_stop_request_during_a_tool_call_kills_it_within_a_fraction_of_a_second(pool):
    runner = ToolRunner(load_tools(["multiturn_envs:nap"]), pool, "plain", timeout_s=600)
    flag = threading.Event()
    threading.Timer(0.5, flag.set).start()
    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        runner.step(["<call>nap 600</call>"] * 2, [0, 1], should_stop=flag.is_set)
    took = time.perf_counter() - t0
    assert took < 0.5 + 2, took
    assert pool.pids == [] and pool.num_kills == 2


# ----------------------------------------------------------------------------------------------
# Environments
# ----------------------------------------------------------------------------------------------


def test_an_environment_class_runs_in_the_workers_row_by_row(pool):
    runner = ClassRunner("multiturn_envs:Countdown", {"turns": 2}, pool, timeout_s=10)
    first = runner.reset([{"id": "a", "prompt": "p0", "answer": None}, {"id": "b", "prompt": "p1", "answer": None}])
    assert first == ["p0", "p1"]
    one = runner.step(["x", "y"], [0, 1])
    assert [(r.observation, r.reward, r.done) for r in one] == [([{"role": "user", "content": "again 1"}], None, False)] * 2
    two = runner.step(["x"], [1])  # each row's object keeps its own state
    assert (two[0].observation, two[0].reward, two[0].done) == (None, 0.5, True)
    assert runner.step(["x"], [0])[0].done
    runner.end([0, 1])


def test_a_broken_environment_ends_its_row_or_is_refused_at_reset(pool):
    runner = ClassRunner("multiturn_envs:Raising", {}, pool, timeout_s=10)
    runner.reset([{"id": "a", "prompt": "p", "answer": None}])
    (r,) = runner.step(["x"], [0])
    assert r.done and r.error == ("multiturn_envs:Raising.step() of row 0 failed: RuntimeError: the environment broke "
                                  f"(at {HERE}/multiturn_envs.py:{_line_of('the environment broke')})")
    bad = ClassRunner("multiturn_envs:BadStep", {}, pool, timeout_s=10)
    bad.reset([{"id": "a", "prompt": "p", "answer": None}])
    (r,) = bad.step(["x"], [0])
    assert "it must return (observation, reward, done)" in r.error
    with pytest.raises(EnvError, match=r"multiturn_envs:Countdown\(\*\*env.kwargs\) failed: TypeError"):
        ClassRunner("multiturn_envs:Countdown", {"nope": 1}, pool, timeout_s=10).reset(
            [{"id": "a", "prompt": "p", "answer": None}])
    with pytest.raises(ValueError, match="E.step\(\) returned reward nan, not a finite number"):
        check_step(("x", float("nan"), False), "E")


def test_an_async_step_is_awaited_and_a_bad_reward_is_its_row_s_error_naming_the_value(pool):
    """``async def`` reset / step run to their result; one that raises is its row's error with the traceback's last
    line and where (row F). A reward is a number as reward functions return one (numpy scalars too), finite and
    within float32's range; else its row's error names the environment, the row and the value (row C)."""
    runner = ClassRunner("multiturn_envs:AsyncCountdown", {"turns": 1}, pool, timeout_s=10)
    assert runner.reset([{"id": "a", "prompt": "p0", "answer": None}]) == ["p0"]
    (r,) = runner.step(["x"], [0])
    assert (r.reward, r.done, r.error) == (1.0, True, None)
    runner = ClassRunner("multiturn_envs:AsyncRaising", {}, pool, timeout_s=10)
    runner.reset([{"id": "a", "prompt": "p", "answer": None}] * 2)
    _, r = runner.step(["x", "y"], [0, 1])
    assert r.error == ("multiturn_envs:AsyncRaising.step() of row 1 failed: RuntimeError: the async environment broke "
                       f"(at {HERE}/multiturn_envs.py:{_line_of('the async environment broke')})")
    assert r.done and r.error_kind == "RuntimeError"
    said = {}
    for value in ("1e300", "nan", "inf", "np32", "np_nan", "npbool", "text"):
        runner = ClassRunner("multiturn_envs:Rewarding", {"value": value}, pool, timeout_s=10)
        runner.reset([{"id": "a", "prompt": "p", "answer": None}] * 3)
        (r,) = runner.step(["x"], [2])
        said[value] = r.reward if r.error is None else r.error
    prefix = "multiturn_envs:Rewarding.step() of row 2 failed: ValueError: multiturn_envs:Rewarding.step() returned reward "
    assert said == {"1e300": prefix + "1e+300, beyond float32's range (magnitude at most 3.4e+38): the rewards are "
                                      "float32, where it would be inf",
                    "nan": prefix + "nan, not a finite number", "inf": prefix + "inf, not a finite number",
                    "np32": 0.5, "np_nan": prefix + "nan, not a finite number", "npbool": 1.0,
                    "text": prefix + "str '1.0', not a number"}


def test_env_kwargs_that_do_not_fit_the_class_are_refused_at_start_up():
    """A misspelt env.kwargs key is said when the job builds its runner (before the warm start), with the class's
    parameters; kwargs that fit build it."""
    from megatron_gspo.config import EnvConfig
    from megatron_gspo.env.protocol import build_runner

    name = "megatron_gspo.env.games:GuessWithFeedback"
    with pytest.raises(EnvError) as e:
        build_runner(EnvConfig(name=name, kwargs={"discont": 0.5}), "plain")
    assert str(e.value) == (f"env.kwargs={{'discont': 0.5}} do not fit {name}(discount=0.5): got an unexpected keyword "
                            "argument 'discont'")
    runner = build_runner(EnvConfig(name=name, kwargs={"discount": 0.25}), "plain")
    runner.pool.close()


_FILE_ENV = '''
from dataclasses import dataclass


@dataclass
class Said:
    observation: object
    reward: object
    done: bool


class Env:
    def reset(self, example):
        return "go " + str(example["prompt"])

    def step(self, response):
        return Said(None, float(len(response)), True)


def shout(text: str) -> str:
    """Shout.

    Args:
        text: what to shout
    """
    return text.upper()
'''


def test_an_environment_or_a_tool_in_a_file_is_imported_as_a_reward_plug_in(tmp_path, pool):
    """env.name / env.tools take ``path/to/file.py:Name`` (in the trainer and in the workers); a module that raises,
    has a syntax error or calls sys.exit while it is imported is one EnvError naming it (issue 47, rows D and E)."""
    from megatron_gspo.config import EnvConfig
    from megatron_gspo.env.protocol import build_runner

    (tmp_path / "file_env.py").write_text(_FILE_ENV)
    runner = build_runner(EnvConfig(name=f"{tmp_path}/file_env.py:Env", num_workers=2), "plain")
    try:
        assert runner.reset([{"id": "a", "prompt": "p", "answer": None}]) == ["go p"]
        (r,) = runner.step(["abc"], [0])
        assert (r.observation, r.reward, r.done, r.error) == (None, 3.0, True, None)
    finally:
        runner.pool.close()
    tools = ToolRunner(load_tools([f"{tmp_path}/file_env.py:shout"]), pool, "plain", timeout_s=10)
    (r,) = tools.step(["<call>shout hi</call>"], [0])
    assert r.observation == [{"role": "tool", "content": "HI"}]
    for n, (body, says) in enumerate([("class Env(:\n    pass\n", "SyntaxError: "),
                                      ("raise RuntimeError('broken at import')\n", "RuntimeError: broken at import"),
                                      ("import sys\nsys.exit(0)\n", "SystemExit: 0"),
                                      ("import sys\nsys.exit(3)\n", "SystemExit: 3")]):
        path = tmp_path / f"broken_{n}.py"
        path.write_text(body)
        for key, cfg in (("env.name", dict(name=f"{path}:Env")), ("env.tools", dict(tools=[f"{path}:f"]))):
            with pytest.raises(EnvError) as e:
                build_runner(EnvConfig(**cfg), "plain")
            assert str(e.value).startswith(f"{key}: '{path}:") and f"loading {path} failed: {says}" in str(e.value)
            assert "\n" not in str(e.value)


def test_the_guessing_game_answers_higher_lower_and_ends_on_the_number():
    from megatron_gspo.env.games import GuessWithFeedback

    env = GuessWithFeedback(discount=0.5)
    assert env.reset({"id": "1", "prompt": "3+4=", "answer": "7"}) == "3+4="
    assert env.step("5") == ("higher", None, False)
    assert env.step("no idea") == ("a number, please", None, False)
    assert env.step("9") == ("lower", None, False)
    assert env.step("7") == (None, 0.5 ** 3, True)


# ----------------------------------------------------------------------------------------------
# Chat formats: the plain one, and Qwen3's real template
# ----------------------------------------------------------------------------------------------


def test_the_plain_format_and_a_demonstration_tokenize_as_the_rollout_builds_the_row():
    from megatron_gspo.data.tokenizer import CharTokenizer

    tok = CharTokenizer()
    fmt = PlainFormat(tok, add_special_tokens=False)
    messages = [{"role": "user", "content": "6*7="}, {"role": "assistant", "content": "<call>calculator 6*7</call>"},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]
    ids, mask = conversation_ids(fmt, messages)
    assert tok.decode(ids) == "6*7=<call>calculator 6*7</call><eos><tool>42</tool>42<eos>"
    text = tok.decode(ids)
    sampled = "".join(ch for ch, m in zip(_chars(tok, ids), mask) if m)
    assert sampled == "<call>calculator 6*7</call><eos>42<eos>" and text.count("<eos>") == 2
    with pytest.raises(EnvError, match="ends with an assistant turn"):
        conversation_ids(fmt, messages[:3])
    with pytest.raises(EnvError, match="two assistant turns in a row"):
        conversation_ids(fmt, [messages[0], messages[1], messages[1]])


def _chars(tok, ids):
    return [tok.decode([i]) for i in ids]


def _qwen3_tokenizer(tmp_path):
    """A Qwen3-layout tokenizer directory (tests/test_tokenizer.py's BPE) with the published Qwen3 chat template
    (tests/fixtures/qwen3_chat_template.jinja) and Qwen3's tool tokens."""
    from test_tokenizer import _write_hf_tokenizer

    from megatron_gspo.data.tokenizer import HFTokenizer

    template = open(os.path.join(HERE, "fixtures", "qwen3_chat_template.jinja")).read()
    d = tmp_path / "qwen3"
    tok = _write_hf_tokenizer(d, template=template)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])  # Qwen3: added, not special
    tok.save(str(d / "tokenizer.json"))
    return HFTokenizer(d)


def test_qwen3_observations_are_the_template_s_tool_turn_appended_once(tmp_path):
    tok = _qwen3_tokenizer(tmp_path)
    fmt = TemplateFormat(tok)
    tools = [load_tool("calculator").schema()]
    prompt = tok.decode(fmt.prompt_ids("what is 12*3?", tools))
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert json.dumps(tools[0]) in prompt and prompt.endswith("<|im_start|>user\nwhat is 12*3?<|im_end|>\n<|im_start|>assistant\n")
    im_end = tok.token_to_id("<|im_end|>")
    obs = fmt.observation_ids([{"role": "tool", "content": "36"}], after=im_end)
    # the newline after the sampled <|im_end|> included, never lost; no second <|im_end|>
    assert tok.decode(obs) == "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    feedback = fmt.observation_ids([{"role": "user", "content": "higher"}], after=im_end)
    assert tok.decode(feedback) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    no_think = TemplateFormat(tok, {"enable_thinking": False}).observation_ids([{"role": "tool", "content": "36"}], im_end)
    assert tok.decode(no_think).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_tokens_the_tools_schemas_add_to_every_prompt_are_said_at_start_up(tmp_path):
    """(issue 47) Qwen3's template lists the tools in its system prompt: hundreds of tokens of every prompt, said
    with what data.max_prompt_length leaves; nothing for the plain format, which shows no schema."""
    import logging

    from megatron_gspo.rollout.multiturn import tools_prompt_note

    tok = _qwen3_tokenizer(tmp_path)
    fmt = TemplateFormat(tok)
    tools = [load_tool("calculator").schema()]
    shown, bare = len(fmt.prompt_ids("?", tools)), len(fmt.prompt_ids("?"))
    assert shown - bare > 100
    level, said = tools_prompt_note(fmt, tools, 1024)
    assert level == logging.INFO and said == (
        f"env.tools: the chat template shows the tools' schemas in every prompt: {shown - bare} tokens (a 1-character "
        f"message renders to {shown}); data.max_prompt_length=1024 leaves {1024 - shown + 1} tokens for the message itself")
    level, said = tools_prompt_note(fmt, tools, 64)
    assert level == logging.WARNING and said.endswith("leaves 0 tokens for the message itself: every prompt is over it; "
                                                      "raise data.max_prompt_length")
    from megatron_gspo.data.tokenizer import CharTokenizer

    assert tools_prompt_note(PlainFormat(CharTokenizer()), tools, 64) is None and tools_prompt_note(fmt, [], 64) is None


def test_qwen3_the_stream_is_the_sampled_tokens_and_rerendering_would_rewrite_think(tmp_path):
    """The row a multi-turn rollout trains on is prompt + the sampled ids + the observation ids. Rendering the
    whole conversation again with the template (what re-tokenizing frameworks do) rewrites history: Qwen3's
    template drops the <think> block of every assistant turn before the last user message, so the first
    turn's tokens would no longer be the ones the policy sampled (the log-probs, the ratios and the routes
    would be paired with other tokens). The stream keeps them."""
    tok = _qwen3_tokenizer(tmp_path)
    fmt = TemplateFormat(tok)
    im_end = tok.token_to_id("<|im_end|>")
    turns = ["<think>\nguess low\n</think>\n\n5", "<think>\nhigher, so\n</think>\n\n7"]
    sampled = [tok.encode(t) + [im_end] for t in turns]  # what the policy drew, its stop token included
    stream = fmt.prompt_ids("3+4=?") + sampled[0]
    stream += fmt.observation_ids([{"role": "user", "content": "higher"}], im_end) + sampled[1]
    conversation = [{"role": "user", "content": "3+4=?"}, {"role": "assistant", "content": turns[0]},
                    {"role": "user", "content": "higher"}, {"role": "assistant", "content": turns[1]}]
    ids, mask = conversation_ids(fmt, conversation)  # a demonstration is built the same way
    assert ids == stream
    assert [i for i, m in zip(ids, mask) if m] == sampled[0] + sampled[1]
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=False)
    again = tok.encode(rendered)
    first = fmt.prompt_ids("3+4=?")
    assert stream[len(first):len(first) + len(sampled[0])] == sampled[0]
    assert again[len(first):len(first) + len(sampled[0])] != sampled[0]  # re-rendered: not what was sampled
    assert "guess low" in tok.decode(stream) and "guess low" not in rendered
    # that rewrite is the whole difference (plus the newline the template writes after the last turn)
    assert rendered == tok.decode(stream).replace("<think>\nguess low\n</think>\n\n", "", 1) + "\n"


def test_the_pools_wait_on_pipes_numbered_past_1024():
    """A process that holds more than 1024 open files (a long test session; a program that built many
    trainers, each leaving gloo's sockets) gets pipe numbers that select(2) refuses ("filedescriptor out of
    range in select()"): the environment pool and the math checker wait on their workers with poll(2)."""
    import resource

    from megatron_gspo.config import RewardConfig
    from megatron_gspo.data.rewards import build_reward, compute_rewards

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} files: no descriptor past 1024 to test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)), hard))
    # open() takes the lowest free number: hold descriptors until one lands past 1024, so that every number up
    # to it is taken (a long session's process may have free numbers below its highest one) and the pools'
    # pipes get numbers past 1024
    held = [os.open(os.devnull, os.O_RDONLY)]
    while held[-1] <= 1024:
        held.append(os.open(os.devnull, os.O_RDONLY))
    pool, reward = WorkerPool(1), None
    try:
        runner = ToolRunner(load_tools(["multiturn_envs:add"]), pool, "plain", timeout_s=30)
        (result,) = runner.step(['<call>add {"a": 2, "b": 3}</call>'], [0])
        assert result.observation[0]["content"] == "5", result
        reward = build_reward(RewardConfig(name="math"))
        assert compute_rewards(reward, ["q"], [r"\boxed{7}"], ["7"]).tolist() == [1.0]
    finally:
        pool.close()
        if reward is not None:
            reward.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ----------------------------------------------------------------------------------------------
# User code against the worker protocol: output on fd 1, huge results, children that outlive a timeout
# ----------------------------------------------------------------------------------------------


def test_a_tool_writing_to_fd_1_cannot_break_the_protocol_and_its_output_reaches_the_log(pool, capfd):
    """``os.write(1, ...)`` and a child process's output land in the log (the worker's stderr), never in the
    replies: the protocol runs on pipes of its own."""
    runner = ToolRunner(load_tools(["multiturn_envs:noisy"]), pool, "plain", timeout_s=30)
    results = runner.step(["<call>noisy hello</call>", "<call>noisy world</call>"], [0, 1])
    assert [r.observation[0]["content"] for r in results] == ["hello", "world"]
    assert [r.tool_errors for r in results] == [0, 0]
    err = capfd.readouterr().err
    assert err.count('{"ok": "forged"}') == 2 and err.count("noisy tool's child") == 2, err


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_tool_that_hangs_past_its_timeout_takes_its_child_processes_with_it(pool, tmp_path):
    """The timeout kills the worker's whole process group: the programs the tool started too."""
    marker = tmp_path / "pids"
    runner = ToolRunner(load_tools(["multiturn_envs:spawn_and_hang"]), pool, "plain", timeout_s=2.0)
    (r,) = runner.step([f"<call>spawn_and_hang {marker}</call>"], [0])
    assert r.observation[0]["content"] == "error: the tool 'spawn_and_hang' did not answer within 2 s (env.tool_timeout_s)"
    children = [int(p) for p in marker.read_text().split()]
    deadline = time.monotonic() + 5  # orphans are reaped by init shortly after the kill
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in children), [p for p in children if _alive(p)]


def test_a_huge_tool_result_is_cut_in_the_worker_at_the_documented_byte_limit():
    """A tool that returns 20 MB sends 64 KiB over the pipe (env/pool.py's result_byte_limit at
    env.max_observation_tokens=256: 16 bytes a token, at least 64 KiB)."""
    from megatron_gspo.config import EnvConfig
    from megatron_gspo.env.protocol import build_runner

    runner = build_runner(EnvConfig(tools=["multiturn_envs:huge"], max_observation_tokens=256, num_workers=1), "plain")
    try:
        t0 = time.perf_counter()
        (r,) = runner.step(["<call>huge 20</call>"], [0])
        took = time.perf_counter() - t0
        content = r.observation[0]["content"]
        print(f"a 20 MB tool result: {len(content)} bytes back in {took:.2f} s")
        assert len(content) == 65536 and content == ("0123456789" * 10000)[:65536]
        assert r.tool_calls[0]["result"] == content
    finally:
        runner.pool.close()
    from megatron_gspo.env.pool import result_byte_limit

    assert result_byte_limit(256) == 65536 and result_byte_limit(10_000) == 160_000

"""Environments and tools the multi-turn tests run (importable by the env worker processes: the pool hands
them this process's sys.path)."""

import os
import time


class Echo:
    """Says "ok" after every turn and never ends: every row talks until env.max_turns."""

    def __init__(self, reply: str = "ok") -> None:
        self.reply = reply

    def reset(self, example):
        return example["prompt"] if isinstance(example["prompt"], str) else example["prompt"][-1]["content"]

    def step(self, response):
        return self.reply, None, False


class Countdown:
    """Ends after ``turns`` turns with reward 1 / turns; an object result, not a tuple."""

    class Result:
        def __init__(self, observation, reward, done):
            self.observation, self.reward, self.done = observation, reward, done

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, example):
        return str(example["prompt"])

    def step(self, response):
        self.seen += 1
        if self.seen >= self.turns:
            return self.Result(None, 1.0 / self.turns, True)
        return self.Result(f"again {self.seen}", None, False)


class Hanging:
    """Writes its pid to ``marker`` at its first step, then never answers (a stuck tool)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def reset(self, example):
        return str(example["prompt"])

    def step(self, response):
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)


class HangingReset:
    """On the rank ``rank`` (torchrun's RANK; the pool's workers inherit it) writes its pid to ``marker`` in
    its first reset, then never answers; on the other ranks an Echo."""

    def __init__(self, marker: str, rank: int = 0) -> None:
        self.marker, self.mine = marker, int(os.environ.get("RANK", "0")) == rank

    def reset(self, example):
        if self.mine:
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        return str(example["prompt"])

    def step(self, response):
        return "ok", None, False


class Raising:
    def reset(self, example):
        return str(example["prompt"])

    def step(self, response):
        raise RuntimeError("the environment broke")


class BadStep:
    def reset(self, example):
        return str(example["prompt"])

    def step(self, response):
        return "no reward or done"


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first
        b (int): the second,
            0 when left out
    """
    return a + b


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def boom() -> str:
    """Always fails."""
    raise ValueError("no luck")


def crash() -> str:
    """Ends its process."""
    os._exit(3)


class Noisy(Echo):
    """Echo that writes to file descriptor 1 at every reset and step, three ways: ``print``, ``os.write`` (as a C
    library would) and a child process; what it writes looks like the old JSON protocol's lines."""

    def _noise(self, where: str) -> None:
        import subprocess

        print(f"noisy print in {where}")
        os.write(1, b'{"ok": "forged by os.write"}\nnot JSON at all {\n')
        subprocess.run(["echo", f"noisy child process in {where}"], check=True)

    def reset(self, example):
        self._noise("reset")
        return super().reset(example)

    def step(self, response):
        self._noise("step")
        return super().step(response)


def noisy(text: str) -> str:
    """Writes to file descriptor 1, then answers.

    Args:
        text: what to answer
    """
    import subprocess

    os.write(1, b'{"ok": "forged"}\n')
    subprocess.run(["echo", "noisy tool's child"], check=True)
    return text


def huge(megabytes: int) -> str:
    """A result of ``megabytes`` MB of text (a tool that dumps a file).

    Args:
        megabytes: how many
    """
    return "0123456789" * (megabytes * 100_000)


def spawn_and_hang(marker: str) -> str:
    """Starts three child processes (their pids written to ``marker``), then hangs.

    Args:
        marker: a file
    """
    import subprocess

    pids = [subprocess.Popen(["sleep", "600"]).pid for _ in range(3)]
    with open(marker, "w") as f:
        f.write(" ".join(map(str, pids)))
    time.sleep(3600)


class AsyncRaising:
    """An ``async def step`` that raises (issue 47, row F)."""

    def reset(self, example):
        return str(example["prompt"])

    async def step(self, response):
        raise RuntimeError("the async environment broke")


class AsyncCountdown(Countdown):
    """Countdown with ``async def`` reset and step."""

    async def reset(self, example):
        return super().reset(example)

    async def step(self, response):
        return super().step(response)


class Rewarding:
    """Ends at once with the reward ``value`` names: "1e300", "nan", "inf", "np32" (numpy float32 0.5), "np_nan",
    "npbool" (numpy True), "text" (issue 47, row C)."""

    def __init__(self, value: str = "1e300") -> None:
        self.value = value

    def reset(self, example):
        return str(example["prompt"])

    def step(self, response):
        import numpy as np

        value = {"1e300": 1e300, "nan": float("nan"), "inf": float("inf"), "np32": np.float32(0.5),
                 "np_nan": np.float64("nan"), "npbool": np.bool_(True), "text": "1.0", "2e38": 2e38}[self.value]
        return None, value, False if self.value == "2e38" else True


class Accented:
    """Answers every turn with a word the built-in character tokenizer cannot encode (issue 47, row I)."""

    def reset(self, example):
        return str(example["prompt"])

    def step(self, response):
        return "café", None, False


class LongFirst(Echo):
    """Opens with a first message of 400 characters for the prompts of an odd length (a deterministic share of the
    rows): over data.max_prompt_length (issue 47)."""

    def reset(self, example):
        prompt = super().reset(example)
        return prompt + "x" * 400 if len(prompt) % 2 else prompt


class Preamble(Echo):
    """Opens every row with ``preamble`` before the data's prompt (a shared prefix of whole KV blocks: the vLLM
    tier's prefix cache serves it to a prompt's samples) and answers every turn with ``reply``, never ending."""

    def __init__(self, preamble: str = "Answer in digits, then say ok: " * 3, reply: str = "ok") -> None:
        super().__init__(reply)
        self.preamble = preamble

    def reset(self, example):
        return self.preamble + super().reset(example)


def check_turn_spans(rec, r: int, fmt, stops) -> tuple[list[int], list[bool], list[dict]]:
    """Row ``r`` of a multi-turn RolloutRecord whose environment answers "ok" (the envs above): its turns
    tile the response, alternate, carry the loss mask of who wrote them (the policy's turns only), and each
    observation is the chat format's ids of "ok", once, after the turn's stop token (nothing re-rendered).
    Returns the row's ids, loss mask and turn spans."""
    traj, n, plen = rec.trajectories[r], int(rec.seq_lengths[r]), int(rec.prompt_lengths[r])
    ids, mask = rec.tokens[r, :n].tolist(), rec.loss_mask[r, :n].tolist()
    assert not any(mask[:plen]) and not any(rec.loss_mask[r, n:].tolist())
    spans = traj["turns"]
    assert spans[0]["start"] == plen and spans[-1]["end"] == n and spans[-1]["role"] == "assistant"
    for a, b in zip(spans, spans[1:]):
        assert a["end"] == b["start"] and a["role"] != b["role"]  # contiguous, alternating
    for s in spans:
        sampled = s["role"] == "assistant"
        assert mask[s["start"]:s["end"]] == [sampled] * (s["end"] - s["start"])
        lp = rec.sample_logprobs[r, s["start"]:s["end"]]
        assert bool((lp < 0).all()) if sampled else bool((lp == 0).all())
        if not sampled:
            assert ids[s["start"]:s["end"]] == fmt.observation_ids([{"role": "user", "content": "ok"}], None)
            assert ids[s["start"] - 1] in stops
    return ids, mask, spans

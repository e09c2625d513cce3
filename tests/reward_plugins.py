"""Reward plug-ins used by tests (loaded as `path/to/reward_plugins.py:function`)."""


def digit_fraction(prompt: str, response: str, answer=None, **kwargs) -> float:
    """Share of digit characters in the response: dense and non-constant even for a random model,
    so advantages are non-zero from the first step."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def slow_digit_fraction(prompt: str, response: str, answer=None, **kwargs) -> float:
    """digit_fraction, 50 ms per response: keeps a short test run alive long enough to be signalled
    between two steps however fast the step itself has become."""
    import time

    time.sleep(0.05)
    return digit_fraction(prompt, response, answer)


def nan_reward(prompt: str, response: str, answer=None, **kwargs) -> float:
    """A broken reward (docs/troubleshooting.md's catalogue runs it): training must stop on it."""
    return float("nan")


def none_reward(prompt: str, response: str, answer=None, **kwargs):
    """A reward that forgot its return statement (docs/troubleshooting.md's catalogue)."""
    return None


def constant_for_odd_first_operand(prompt: str, response: str, answer=None, **kwargs) -> float:
    """Constant (0) for every response to a prompt whose first digit is odd, the digit share of the
    response otherwise: a mix of constant and informative groups for dynamic sampling tests."""
    first = next((c for c in prompt if c.isdigit()), "0")
    return 0.0 if int(first) % 2 else digit_fraction(prompt, response)


def always_zero(prompt: str, response: str, answer=None, **kwargs) -> float:
    """Every group constant: dynamic sampling never finds an informative one."""
    return 0.0


def always_one(prompt: str, response: str, answer=None, **kwargs) -> float:
    """Every response correct."""
    return 1.0


def response_hash(prompt: str, response: str, answer=None, **kwargs) -> float:
    """A score in [0, 1) that differs between different responses (a hash of the text): every group
    of distinct samples is informative, so dynamic sampling keeps its first round whole."""
    import zlib

    return (zlib.crc32(response.encode()) % 9973) / 9973


def coin_of_the_text(prompt: str, response: str, answer=None, **kwargs) -> float:
    """1 or 0 by a hash of the response: about half of an untrained model's answers correct, and which ones
    depends on every token, so evaluation metrics differ where any sampled token does."""
    import zlib

    return float(zlib.crc32(response.encode()) % 2)


def huge_reward(prompt: str, response: str, answer=None, **kwargs) -> float:
    """Finite in Python, inf in float32 (the rewards' dtype): refused like inf (the catalogue runs it)."""
    return 1e300


def slow_reward(prompt: str, response: str, answer=None, *, seconds: float = 1.0, marker: str = "") -> float:
    """``seconds`` per response (a verifier on hard inputs), appending a line to ``marker`` (a file) as each
    response starts: a test knows when scoring is under way, and how many responses were begun."""
    import os
    import time

    if marker:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    return digit_fraction(prompt, response, answer)


def gated(prompt: str, response: str, answer=None, *, gate: str = "") -> float:
    """digit_fraction once the file ``gate`` exists (at most 10 minutes): a job holds its step here until
    the test lets it go, whatever the machine's load."""
    import os
    import time

    deadline = time.time() + 600
    while not os.path.exists(gate) and time.time() < deadline:
        time.sleep(0.05)
    return digit_fraction(prompt, response, answer)


def dies_on(prompt: str, response: str, answer=None, *, word: str = "die") -> float:
    """Ends its process (as a crash in native code would) on the response ``word``; its length otherwise."""
    import os

    if response == word:
        os._exit(3)
    return float(len(response))


def noisy_length(prompt: str, response: str, answer=None) -> float:
    """Writes to file descriptor 1 (as a C library or a program it runs would), then scores the response's length."""
    import os
    import subprocess

    os.write(1, b"noisy reward wrote this\n")
    subprocess.run(["echo", "noisy reward's child"], check=True)
    return float(len(response))


def sigterm_at(prompt: str, response: str, answer=None, *, call: int = 1, marker: str = "", pid: int = 0) -> float:
    """``digit_fraction``, and SIGTERM to the process ``pid`` (the trainer's) as the ``call``-th response is scored
    (counted in ``marker``, a file, in this process or a reward worker's; sent once): a stop signal that lands
    in the middle of scoring, at a chosen step, however loaded the machine is."""
    import os
    import signal

    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\n")
    with open(marker) as f:
        n = len(f.read().split())
    if n >= call:
        try:
            os.close(os.open(marker + ".sent", os.O_CREAT | os.O_EXCL))  # once, whichever worker gets there first
            os.kill(pid, signal.SIGTERM)
        except FileExistsError:
            pass
    return digit_fraction(prompt, response, answer)

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

"""Reward plug-ins used by tests (loaded as `path/to/reward_plugins.py:function`)."""


def digit_fraction(prompt: str, response: str, answer=None, **kwargs) -> float:
    """Share of digit characters in the response: dense and non-constant even for a random model,
    so advantages are non-zero from the first step."""
    return sum(c.isdigit() for c in response) / max(1, len(response))

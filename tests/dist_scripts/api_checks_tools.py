"""The tools of tests/dist_scripts/api_checks.py, shared with the fixture that teaches a tiny model to call them."""

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def explode(x: int) -> int:
    """A tool that always fails.

    Args:
        x: Any number.
    """
    raise ValueError("the tool broke on purpose")


def stall(x: int) -> int:
    """A tool that never answers in time.

    Args:
        x: Any number.
    """
    time.sleep(30)
    return x


TOOLS = [add, explode, stall]

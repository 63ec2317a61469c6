"""Hypothesis's ``find`` without its example database, for the tests that assert what a strategy
shrinks to: ``find`` keys saved examples by a digest of its predicate, which two tests' lambdas
can share, so a database a previous run left in the working directory could replay one test's
example in another and change where it shrinks to. Derandomized: the same run every time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import hypothesis
from hypothesis import settings
from hypothesis.strategies import SearchStrategy

T = TypeVar("T")


def find(strategy: SearchStrategy[T], condition: Callable[[T], object], **kwargs: object) -> T:
    kwargs.setdefault("settings", settings(max_examples=2000, database=None, derandomize=True))
    return hypothesis.find(strategy, condition, **kwargs)  # type: ignore[arg-type]

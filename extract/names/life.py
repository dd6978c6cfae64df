"""The store life cycle's actions (``store/life.py``): what a run does with the store at ``--out``."""

from __future__ import annotations

from enum import StrEnum


class Action(StrEnum):
    """What ``StoreLife.decide`` says a run does with its store: ``create`` it (none there, or
    ``--overwrite``), ``resume`` it (the same job, chunks left to write) or find it ``complete`` (nothing
    to do). A ``StrEnum``, so that it prints, compares and records as the word it was."""

    CREATE = "create"
    RESUME = "resume"
    COMPLETE = "complete"

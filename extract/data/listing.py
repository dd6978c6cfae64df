"""Listing a data set once per job, not once per rank: made by rank 0 and broadcast, or split across
ranks and gathered. A failure on any rank reaches every rank as the same ``ExtractError``, so no
rank is left waiting at a collective. The work splits over every process of the job (``Processes``'
``process_index`` of ``num_processes``), tensor-parallel or not."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from ..errors import ExtractError

if TYPE_CHECKING:
    from ..processes import Processes

T = TypeVar("T")
A = TypeVar("A")


def _distributed(ranks: Processes | None) -> bool:
    return ranks is not None and ranks.num_processes > 1 and dist.is_available() and dist.is_initialized()


def _attempt(make: Callable[[], T]) -> tuple[str, Any]:
    try:
        return "ok", make()
    except ExtractError as e:
        return "error", str(e)
    except Exception as e:  # noqa: BLE001 - re-raised below on this rank; the others get its text
        return "crash", e


def _settle(outcome: tuple[str, Any], here: bool) -> Any:
    status, value = outcome
    if status == "error":
        raise ExtractError(value)
    if status == "crash":
        if here:
            raise value
        raise ExtractError(f"listing the data failed on another rank ({value.__class__.__name__}: {value})")
    return value


def on_one_rank(ranks: Processes | None, make: Callable[[], T]) -> T:
    """``make()`` on rank 0 only; every rank gets its result (or its error)."""
    if not _distributed(ranks):
        return make()
    box: list[Any] = [_attempt(make) if ranks.process_index == 0 else None]  # type: ignore[union-attr]
    dist.broadcast_object_list(box, src=0)
    return _settle(box[0], ranks.process_index == 0)  # type: ignore[union-attr]


def split_across_ranks(ranks: Processes | None, items: Sequence[A], work: Callable[[A], T]) -> list[T]:
    """``[work(item) for item in items]``, each rank doing every world-size-th item; all ranks get
    the whole list, in the order of ``items``."""
    if not _distributed(ranks):
        return [work(item) for item in items]
    rank, world = ranks.process_index, ranks.num_processes  # type: ignore[union-attr]
    mine = _attempt(lambda: [work(item) for item in items[rank::world]])
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    for other, outcome in enumerate(gathered):
        if outcome[0] != "ok":
            _settle(outcome, other == rank)
    results: list[T] = [None] * len(items)  # type: ignore[list-item]
    for other, (_, values) in enumerate(gathered):
        results[other::world] = values
    return results

"""Batches placed on the devices one step ahead of the step that reads them.

The trainer takes a batch that is already on the devices, dispatches the step, and only then
reads the next batch from the host and places it (`fill`), so the copy and the host's reading
overlap the step instead of delaying it. The data position a checkpoint saves is that of the
batches the steps have taken, not of the one waiting: a run resumed from it reads the waiting
batch again, as the uninterrupted run did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Feed:
    """A batch iterator (Grain's: `next`, `get_state`, `set_state`) read one batch ahead and
    placed by `put`."""

    def __init__(self, batches, put: Callable[[dict[str, Any]], dict[str, Any]]):
        self.batches, self.put = batches, put
        self._taken_state = batches.get_state()  # after the last batch a step took
        self.before_last = self._taken_state  # before it
        self._waiting = None  # (the placed batch, the iterator's state after it)

    def take(self) -> dict[str, Any]:
        """The next batch, on the devices."""
        if self._waiting is None:
            self.fill()
        self.before_last = self._taken_state  # where a step that fails may go on from
        batch, self._taken_state = self._waiting
        self._waiting = None
        return batch

    def fill(self) -> None:
        """Read and place the batch after the last one taken (nothing if one waits)."""
        if self._waiting is None:
            batch = self.put(next(self.batches))
            self._waiting = (batch, self.batches.get_state())

    def get_state(self) -> Any:
        """Where the data stands after the batches taken (the one waiting not counted)."""
        return self._taken_state

    def set_state(self, state: Any) -> None:
        self.batches.set_state(state)
        self._taken_state, self._waiting = state, None

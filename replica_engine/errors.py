"""Errors of a running engine (a bad request is common.errors.InvalidRequestError)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replica_engine.outputs import CoreOutput


class StepFailedError(RuntimeError):
    """Every request of an engine step failed, even each on its own (the engine may be broken).
    They are finished with reason `error`: `outputs` are their final CoreOutputs."""

    def __init__(self, outputs: list[CoreOutput]) -> None:
        super().__init__(f"every request of a step failed: {[o.request_id for o in outputs]}")
        self.outputs = outputs


class EngineDeadError(RuntimeError):
    """The step loop died; no request can be served by this engine any more."""

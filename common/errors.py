"""The error a caller can act on, raised wherever a request is checked (Ingress, engine)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or setting is invalid; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
        self.code = code

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        """Pickles with its fields (the engine core's process sends a bad setting's error back)."""
        return type(self), (self.param, self.message, self.code)

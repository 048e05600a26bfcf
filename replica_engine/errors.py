"""Errors a caller can act on."""


class InvalidRequestError(ValueError):
    """A request or setting is invalid; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.code = code

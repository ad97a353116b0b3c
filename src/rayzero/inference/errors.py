"""The one error type of the inference actor."""


class InferenceError(ValueError):
    """A request was malformed or could not be served; only that request fails."""

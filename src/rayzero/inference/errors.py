"""The error types of the inference actor."""


class InferenceError(ValueError):
    """A request was malformed or could not be served; only that request fails."""


class InferenceOverloaded(InferenceError):
    """The actor's queues hold `inference.max_queue` rows: the request was not taken; send it again later."""

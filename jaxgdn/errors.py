"""Exceptions raised by jaxgdn. Each names what was wrong so callers and the CLI can report one clear line."""


class JaxGDNError(Exception):
    """Base class for jaxgdn's own errors."""


class CheckpointError(JaxGDNError):
    """A checkpoint directory is missing, malformed, or does not match the config (names the file or tensor)."""


class UnsupportedModelError(CheckpointError):
    """config.json names a model_type jaxgdn does not implement."""


class InputError(JaxGDNError, ValueError):
    """Bad input to a state function: token ids out of range, wrong dtype or rank, lengths, capacity."""


class CapacityError(InputError):
    """The KV cache of a state has no room for the tokens asked for."""

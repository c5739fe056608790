"""memfit's exception types. The CLI prints these as one line and exits with code 2."""


class MemfitError(Exception):
    """Bad input or an impossible request. The message says what was wrong and what would work."""


class ConfigError(MemfitError, ValueError):
    """A model spec, size, precision, policy or path that memfit cannot use."""


class DoesNotFitError(MemfitError):
    """The requested configuration needs more memory than the budget allows."""


class CorruptCheckpointError(ConfigError):
    """A checkpoint whose checksums do not hold: the message names what is corrupt."""

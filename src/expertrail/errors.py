"""Exceptions raised by expertrail.

Every error that depends on one rank's input is agreed on by all ranks of the group before
anyone enters a collective that could wait forever (see `dispatch.base`), so a bad input on
one rank raises on every rank instead of hanging the others.
"""


class ExpertrailError(Exception):
    """Base class of every expertrail error."""


class InvalidInputError(ExpertrailError, ValueError):
    """A tensor passed to dispatch/combine has the wrong shape, dtype, device or values."""


class ConfigError(ExpertrailError, ValueError):
    """A construction argument is invalid (sizes that do not divide, unknown backend...)."""


class ConfigMismatchError(ConfigError):
    """Ranks of one group were constructed with different settings."""


class CollectiveError(ExpertrailError, RuntimeError):
    """A collective failed or timed out: a rank exited or stopped calling in."""

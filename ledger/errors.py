"""One base exception for the project; each subclass's docstring is its default message."""


class LedgerError(Exception):
    """Stripe ledger error."""

    def __init__(self, message: str | None = None):
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigError(LedgerError):
    """Invalid configuration."""


class MigrationError(LedgerError):
    """The database schema cannot be brought up to date."""


class DatabaseUnavailable(LedgerError):
    """Postgres is unreachable or refused the statement."""


class LeaseLost(LedgerError):
    """The lease was taken over by another worker; this attempt must not commit."""

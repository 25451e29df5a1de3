"""User-facing errors: raised for bad input, printed as one line by the CLI (no traceback)."""


class UserError(Exception):
    """Something the user asked for cannot be done; the message says what was wrong and what to do."""

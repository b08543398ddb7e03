"""One module per `dflash` command (cli.py parses and dispatches to them lazily), and the error they
all raise for a user's mistake."""


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""

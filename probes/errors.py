"""The one error type a user sees: a message for one line, and an exit code.

Any layer raises :class:`InputError` for bad input (a missing or malformed file, a bad
option, a config error). The CLI prints ``ridgeline: error: <message>`` and exits with
``exit_code`` (2), never a traceback.
"""


class InputError(Exception):
    """Bad input from the user or the outside world; the message is one clear line."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code

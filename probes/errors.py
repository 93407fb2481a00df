"""The error types a user sees: a message for one line, and an exit code.

Any layer raises :class:`InputError` for bad input (a missing or malformed file, a bad
option, a config error; exit 2) and :class:`RuntimeFailure` when the input was fine but
what the command needed did not happen (no agent answering, no data in time, a probe
that cannot run here; exit 1). The CLI prints ``ridgeline: error: <message>`` and exits
with ``exit_code``, never a traceback.
"""


class InputError(Exception):
    """Bad input from the user or the outside world; the message is one clear line."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class RuntimeFailure(Exception):
    """The input was fine, but what the command needed did not happen; one line, exit 1."""

    exit_code = 1

"""The one exception type users see.

Anything a user can fix (a flag, an environment id, a device split, a checkpoint)
is raised as `PodracerError` with a one-line message that says what to do. The
launcher prints it without a traceback and exits with status 2.
"""


class PodracerError(Exception):
    """A problem the user can fix; the message is one line and says how."""

    exit_code = 2


class Interrupted(Exception):
    """A run stopped by a signal, after saving (training) or cleaning up (the provisioner).

    The exit status is 128 + the signal, as a shell reports it: 130 for Ctrl-C.
    """

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum

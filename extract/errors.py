"""The one error type the command line turns into a one-line message and exit status 2."""


class ExtractError(Exception):
    """Bad input or environment: the message names the culprit and the fix."""

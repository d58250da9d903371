"""The one exception type for bad input: a file, tensor or field that is wrong.

It subclasses ValueError so plain `except ValueError` callers keep working; the command-line
tools turn it into one line on stderr and exit code 2.
"""


class BridgeError(ValueError):
    """Bad input, with a one-line message naming the file / tensor / field and what is wrong."""

"""The one exception type for bad input: a file, tensor or field that is wrong.

It subclasses ValueError so plain `except ValueError` callers keep working. Library code names
what is wrong in its own words - a file, a tensor, or a field (a parameter or config field, passed
as `field=`), and may say which parameter would fix it (`hint=`):

    BridgeError("must be a positive integer (got 0)", field="steps")
        steps: must be a positive integer (got 0)
    BridgeError("ckpt: already exists", hint=("force", True, "use {} to replace it"))
        ckpt: already exists (use force=True to replace it)

The command-line layer turns the error into one line on stderr and exit code 2, showing each
parameter as the flag that sets it (`--steps: ...`, `(use --force to replace it)`).
"""

from __future__ import annotations

from typing import Any, Callable

Hint = tuple[str, Any, str]  # (parameter, value, text with {} where the setting goes)


def python_setting(parameter: str, value: Any) -> str:
    """How a library caller sets a parameter: force=True, truncate='left'."""
    return f"{parameter}={value!r}"


class BridgeError(ValueError):
    """Bad input, with a one-line message naming the file / tensor / field and what is wrong."""

    def __init__(self, message: str, *, field: str | None = None, hint: Hint | None = None):
        self.field = field      # the parameter or config field at fault, if one is
        self.message = message  # the message without the field or the hint
        self.hint = hint
        super().__init__(self.render())

    def render(self, name: Callable[[str], str] = str,
               setting: Callable[[str, Any], str] = python_setting) -> str:
        """The message, with the field shown as name(field) and the hint's parameter set as
        setting(parameter, value): library words by default, flags in the command line."""
        text = self.message
        if self.hint is not None:
            parameter, value, template = self.hint
            text += f" ({template.format(setting(parameter, value))})"
        return f"{name(self.field)}: {text}" if self.field else text

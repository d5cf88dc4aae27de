"""The one exception family the command line turns into exit code 2.

``InputError`` marks a problem with what the user gave a command — a config file, a dataset row, an SFT
file, a checkpoint to resume from, a tool setting the machine cannot honour — as opposed to a failure
of the run itself. Its message names the file/key/row and the fix; ``megatron_arpo.cli`` prints it on
one line, with no traceback, and exits 2. ``ConfigError``, ``DatasetError``, ``SFTDataError`` and
``ResumeError`` are InputErrors.
"""


class InputError(ValueError):
    """Bad user input; the message says what is wrong, where, and how to fix it."""

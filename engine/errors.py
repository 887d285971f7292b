"""Errors a user sees. Every message is one line that says what is wrong and, where it can,
what to do; the CLI prints `str(error)` and exits non-zero instead of a traceback."""


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first line (its type's name if it has none): what a
    one-line report of someone else's error can show."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class TrellisError(Exception):
    """Base class: anything the user can fix (bad input, impossible settings)."""


class FormatError(TrellisError):
    """A file is not what the format says it must be (truncated, corrupt, inconsistent)."""


class ModelLoadError(TrellisError):
    """A model folder cannot be loaded (missing files or tensors)."""


class UnsupportedArchitecture(TrellisError):
    """The model's `architectures[0]` is not one Trellis knows."""


class ConfigError(TrellisError):
    """config.json (or another settings file) is missing, malformed or contradictory."""

"""User-facing errors: one clear line, no traceback (the CLI exits 2, the server answers 4xx)."""


class SpeculantError(Exception):
    """A problem the user can fix (bad file, bad flag, prompt too long). str() is the whole message."""


class ModelFileError(SpeculantError):
    """The model file is missing, not GGUF, truncated, or uses something we do not support."""


class LimitError(SpeculantError):
    """A request exceeds a limit (context length, token budget)."""


class DeviceUnavailable(SpeculantError):
    """A backend's device is missing here (no GPU, no driver). Raised by the backend's constructor;
    the message says what is missing."""

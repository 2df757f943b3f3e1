"""The dflash2 exception tree: every failure a user can cause is a ``DFlash2Error``.

Each message says what went wrong and what to do about it.
"""

from __future__ import annotations


class DFlash2Error(Exception):
    """Base class of every error dflash2 raises on purpose."""


class InvalidOptionError(DFlash2Error, ValueError):
    """A generation or load option has a wrong name, type or value."""


class InvalidPromptError(DFlash2Error, ValueError):
    """The prompt is neither a string nor a list of chat messages, or is empty."""


class ContextLengthError(DFlash2Error, ValueError):
    """Prompt plus ``max_new_tokens`` does not fit in the model's context window."""


class ModelNotFoundError(DFlash2Error, FileNotFoundError):
    """No model exists at the given path or hub id."""


class OfflineModelError(ModelNotFoundError):
    """The hub is offline (``HF_HUB_OFFLINE``) and the model is not in the local cache."""


class CorruptCheckpointError(DFlash2Error, ValueError):
    """A checkpoint file exists but cannot be read: truncated, corrupted or malformed."""


class UnsupportedModelError(DFlash2Error):
    """The checkpoint's architecture or one of its settings is not supported by the runtime."""


class TokenizerMismatchError(DFlash2Error):
    """A drafter's tokenizer differs from the target's, so its tokens cannot be verified."""


class DrafterError(DFlash2Error):
    """A drafter checkpoint or drafter object is invalid."""


class StreamStateError(DFlash2Error, RuntimeError):
    """A stream or API call was used in a state that does not allow it."""


class CacheDirectoryError(DFlash2Error, OSError):
    """dflash2's cache directory (``DFLASH2_CACHE``) cannot be created or written."""


class OutputDirectoryError(DFlash2Error, OSError):
    """A drafter training run cannot write its output directory (``--out``): a full disk, a
    read-only folder. What it wrote before stays, and the same command resumes from it."""


class MissingDependencyError(DFlash2Error, ImportError):
    """An optional dependency needed for this feature is not installed."""

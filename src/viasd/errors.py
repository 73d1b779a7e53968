"""Errors a user can cause and fix. The CLI prints their message on one line and exits with `exit_code`."""

from __future__ import annotations


class ViasdError(Exception):
    """Base class of every error viasd raises on purpose. Message: one line, says what to do."""

    exit_code = 1


class UsageError(ViasdError):
    """Bad input from the user: unknown names, missing files, inconsistent options (exit 2)."""

    exit_code = 2


class InvalidArgumentError(UsageError):
    """A setting of the wrong type, NaN / infinite, or out of its range (checked before any model loads)."""


class InvalidPromptError(UsageError):
    """A prompt that is not UTF-8 text, chat messages, or in-vocabulary integer token ids."""


class NotWritableError(UsageError):
    """An output path (or the cache directory) that cannot be written; checked before the work."""


class OutputBusyError(UsageError):
    """An output another viasd process is writing right now (a second `bench` on the same file)."""


class MalformedFileError(UsageError):
    """A JSON input (route, thresholds, bench results) that parses but has the wrong shape or types."""


class UnknownModelError(UsageError):
    pass


class ModelNotFoundError(UsageError):
    pass


class CorruptFileError(UsageError):
    """A model or cache file that exists but cannot be read as what it claims to be."""


class ChecksumError(CorruptFileError):
    """A file whose sha256 differs from the recorded one."""


class CorruptCacheError(CorruptFileError):
    """A cache entry (a converted model, a compiled kernel, the cache's own layout) that fails
    verification and could not be rebuilt automatically; the message says what to delete."""


class CorruptGGUFError(CorruptFileError):
    """A GGUF file whose tensor data or layout cannot be right (non-finite scales, sizes that do not
    match their type and shape); the message names the file and the tensor."""


class NoChatTemplateError(UsageError):
    """Chat formatting was asked of a model without a chat template."""


class UnsupportedArchitectureError(UsageError):
    pass


class VocabularyMismatchError(UsageError):
    pass


class FetchError(ViasdError):
    """A download failed for a reason outside the user's input (network, disk)."""

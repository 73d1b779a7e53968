"""Errors a user can cause and fix. The CLI prints their message on one line and exits with `exit_code`."""

from __future__ import annotations


class ViasdError(Exception):
    """Base class of every error viasd raises on purpose. Message: one line, says what to do."""

    exit_code = 1


class UsageError(ViasdError):
    """Bad input from the user: unknown names, missing files, inconsistent options (exit 2)."""

    exit_code = 2


class UnknownModelError(UsageError):
    pass


class ModelNotFoundError(UsageError):
    pass


class ChecksumError(UsageError):
    pass


class UnsupportedArchitectureError(UsageError):
    pass


class VocabularyMismatchError(UsageError):
    pass


class FetchError(ViasdError):
    """A download failed for a reason outside the user's input (network, disk)."""

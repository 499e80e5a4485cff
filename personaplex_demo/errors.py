"""Errors a caller can cause. Each message says what was wrong and what is allowed."""

from __future__ import annotations


class CallerError(ValueError):
    """Bad input from one caller: reported to that caller, never fatal to the others."""


class UnknownVoiceError(CallerError):
    pass


class PersonaTooLongError(CallerError):
    pass


class AudioFormatError(CallerError):
    pass


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or does not match the model."""


class VoiceArchiveError(CheckpointError):
    """voices.tgz is unreadable or holds a member that is unsafe to extract."""


class VoiceFileError(CheckpointError):
    """A voice prompt `.pt` file is not the expected {"embeddings", "cache"} tensor dict."""


class ModelDownloadError(CheckpointError):
    """The requested model's files could not be fetched from the Hugging Face Hub."""

"""User-facing errors: one line saying what is wrong, one saying what to do about it."""

from __future__ import annotations


class SwitchyardError(Exception):
    """An error the user can act on. The CLI prints it without a traceback and exits non-zero."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class EngineNotInstalled(SwitchyardError):
    """The engine binary or environment is not provisioned yet."""


class ModelError(SwitchyardError):
    """The model path or repo cannot be used as given."""


class PortBusy(SwitchyardError):
    """A requested TCP port is already taken."""


class EngineFailed(SwitchyardError):
    """The engine process died or never became ready; the message carries the explained reason."""

    exit_code = 3

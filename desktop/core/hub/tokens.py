"""Hugging Face access tokens: from HF_TOKEN, the OS keyring, or the HF CLI's own login; never logged.

Gated repos (Llama, Gemma, ...) need a token from an account that accepted the license. The token is a secret:
it only ever travels in an Authorization header, and any text that may contain it passes through `redact`.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

KEYRING_SERVICE = "switchyard"
KEYRING_USER = "huggingface"


def _keyring_get() -> str | None:
    try:
        import keyring
        from keyring.errors import KeyringError
    except ImportError:  # pragma: no cover - keyring is a declared dependency
        return None
    try:
        value = keyring.get_password(KEYRING_SERVICE, KEYRING_USER)
    except (KeyringError, RuntimeError, OSError) as exc:
        log.debug("keyring unavailable: %s", type(exc).__name__)
        return None
    return value or None


def get_token() -> str | None:
    """The token to use: HF_TOKEN (or HUGGING_FACE_HUB_TOKEN), then the keyring, then `hf auth login`'s file."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    if os.environ.get("SWITCHYARD_NO_KEYRING") != "1":
        stored = _keyring_get()
        if stored:
            return stored
    if os.environ.get("HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        return None
    try:
        from huggingface_hub import get_token as hf_cli_token

        return hf_cli_token()
    except Exception:  # noqa: BLE001 - a broken HF config must not break downloads of public repos
        return None


def set_token(token: str) -> None:
    """Keep a token in the OS keyring (Secret Service, Keychain, Windows Credential Locker)."""
    from desktop.core.common.errors import SwitchyardError

    token = token.strip()
    if not token:
        raise SwitchyardError("The token is empty.", "paste a token from https://huggingface.co/settings/tokens")
    try:
        import keyring
        from keyring.errors import KeyringError

        keyring.set_password(KEYRING_SERVICE, KEYRING_USER, token)
    except (KeyringError, RuntimeError, OSError) as exc:
        raise SwitchyardError(
            f"No usable OS keyring to store the token ({type(exc).__name__}).",
            "set the HF_TOKEN environment variable instead",
        ) from None


def clear_token() -> bool:
    """Forget the keyring token; True if one was stored."""
    try:
        import keyring
        from keyring.errors import KeyringError, PasswordDeleteError

        try:
            keyring.delete_password(KEYRING_SERVICE, KEYRING_USER)
        except PasswordDeleteError:
            return False
        return True
    except (KeyringError, RuntimeError, OSError):
        return False


def redact(text: str, token: str | None = None) -> str:
    """Replace the token (and anything shaped like an HF token) in text meant for logs or the user."""
    import re

    if token:
        text = text.replace(token, "hf_***")
    return re.sub(r"\bhf_[A-Za-z0-9]{8,}\b", "hf_***", text)

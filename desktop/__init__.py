"""Switchyard: pick, launch, watch and A/B local LLM inference engines."""

__version__ = "0.1.0"
APP_NAME = "Switchyard"

"""An OpenAI-compatible server on a loaded model (``dflash2 serve``; install the ``serve`` extra)."""

from dflash2.serve.app import Server, create_app
from dflash2.serve.protocol import APIError, Limits

__all__ = ["APIError", "Limits", "Server", "create_app"]

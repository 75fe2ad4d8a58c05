"""OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn)."""

from gemmaserve.server.app import create_app

__all__ = ["create_app"]

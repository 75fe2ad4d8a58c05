"""Test-only gemmaserve backend that wraps another backend and injects faults (see ``backend.py``)."""

__all__: list[str] = []

"""Benchmarks: ``gemmaserve bench`` (client-side serving benchmark against a running server)."""

__all__: list[str] = []

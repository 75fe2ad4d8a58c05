"""Example third-party backend for gemmaserve: a deterministic toy language model in pure Python."""

__all__: list[str] = []

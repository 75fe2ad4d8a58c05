"""gemmaserve plugin ``custom_torch``: the custom-{cuda,mps,cpu} backends (hand-written Gemma 3/4 forward over
paged KV). Importing this package is light; torch loads when a submodule that needs it is imported."""

__version__ = "0.1.0"

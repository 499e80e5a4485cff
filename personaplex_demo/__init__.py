"""PersonaPlex Live: many callers, one batched full-duplex PersonaPlex-7B engine."""

__version__ = "0.1.0"

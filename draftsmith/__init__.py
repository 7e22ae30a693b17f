"""draftsmith: train, evaluate and export speculative-decoding drafters."""

__version__ = "0.1.0"

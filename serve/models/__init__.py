"""Loading models: the target (converted once from a GGUF or read from an HF folder) and its weights."""

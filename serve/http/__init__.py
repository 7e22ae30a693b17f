"""draftsmith-serve: the engine behind an OpenAI-compatible chat-completions endpoint (FastAPI + uvicorn)."""

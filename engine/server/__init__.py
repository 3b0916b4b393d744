"""cbserve's OpenAI-compatible endpoint (Starlette, run by uvicorn through `cbserve serve`)."""

"""The OpenAI-compatible HTTP server: `blockserve serve` (app.py), its async engine and metrics."""

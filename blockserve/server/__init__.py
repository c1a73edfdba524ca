"""The OpenAI-compatible HTTP server, `blockserve serve`: the app and its routes (app.py), one file
per endpoint (completions.py, chat.py) over what they share (generation.py, streaming.py), errors
(http_errors.py), auth and cache salts (auth.py), the async engine and metrics."""

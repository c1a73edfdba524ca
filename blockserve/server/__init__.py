"""The OpenAI-compatible HTTP server, `blockserve serve`, in four layers:

- app.py, config.py, protocol.py: the app and its routes, its settings, the wire format;
- http/: the HTTP edge (errors in OpenAI's shape, auth and cache salts, limits, deadlines, drain, chat page);
- engine_bridge/: the engine's step loop on a thread, feeding asyncio streams, and its Prometheus metrics;
- openai_api/: one file per endpoint (completions, chat, tokenize) over what they share;
- tools/: tool calling, through a template's own tools section or a JSON envelope.
"""

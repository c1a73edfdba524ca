"""The HTTP edge: errors in OpenAI's shape, who is calling, request limits, header deadlines,
the drain on shutdown and the chat page. Knows nothing of the engine."""

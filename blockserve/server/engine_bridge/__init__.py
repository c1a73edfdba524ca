"""The bridge from asyncio to the engine: its step loop on a background thread feeding one
stream per request, and the Prometheus metrics of what it sees."""

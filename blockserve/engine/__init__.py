"""The step loop, detokenization, the offline LLM and the async engine."""

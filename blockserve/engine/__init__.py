"""The step loop, detokenization, and the offline LLM (the async engine lives in server/)."""

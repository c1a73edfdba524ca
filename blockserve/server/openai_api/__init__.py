"""The OpenAI API's endpoints: /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
over what they share (checks, sampling parameters, streaming, structured outputs)."""

"""blockserve against its peers: transformers and llama.cpp through Python (`run`), llama.cpp built
natively (`native`)."""

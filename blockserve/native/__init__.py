"""Native CPU kernels (csrc/): paged decode attention, fused layer ops, matmuls over GGUF blocks,
a Llama decode stack and sampling, one extension module built for this CPU on first use
(extension.py). attention/, models/ and worker/ call them behind gate.py's test."""

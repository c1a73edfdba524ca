"""lm-eval against a real `blockserve serve` on two local tasks (`python -m benchmarks.lm_eval.smoke`)."""

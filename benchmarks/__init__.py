"""Developer benchmarks, not shipped: each module runs as `python -m benchmarks.<name>` from the
repository root (benchmarks/README.md lists them with their make targets and raw files)."""

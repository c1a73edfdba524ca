"""Attention and recurrent-state backends (CPU reference and fast paths)."""

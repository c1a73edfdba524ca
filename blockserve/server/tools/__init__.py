"""Tool calling: through a chat template's own Hermes-style tools section (hermes.py), or a
grammar-enforced JSON envelope for any other template (envelope.py)."""

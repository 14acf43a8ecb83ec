"""One thin module per CLI command; each exposes ``register(app)``."""

"""Actor kinds."""

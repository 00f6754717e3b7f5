"""Stage 8: measure acceptance length and wall-clock speed against the same engine without speculation."""

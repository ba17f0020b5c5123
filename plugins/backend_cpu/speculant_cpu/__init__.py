"""CPU backend plugin."""

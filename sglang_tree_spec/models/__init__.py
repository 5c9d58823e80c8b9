"""Model-building recipes (drafter training)."""

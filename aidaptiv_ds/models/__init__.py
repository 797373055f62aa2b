"""TODO wing docstring: models."""

"""TODO wing docstring: config."""

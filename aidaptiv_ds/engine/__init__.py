"""TODO wing docstring: engine."""

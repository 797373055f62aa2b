"""TODO wing docstring: swap."""

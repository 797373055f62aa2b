"""TODO wing docstring: common."""

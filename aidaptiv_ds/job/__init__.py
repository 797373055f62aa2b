"""TODO wing docstring: job."""

"""Errors shared by several layers (kept below all of them, so no module imports another just for an exception)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or cannot continue this run."""

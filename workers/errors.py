"""Errors a worker's inputs raise before any engine exists, shared by the config readers and the model importer."""


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file."""

"""Errors that mean "this input cannot be used", raised below the command line, which prints them as one line.

``ConfigError`` (a YAML file or a config section) lives with the config package; ``CheckpointError`` is raised by
every package that reads a checkpoint or a Hugging Face folder (storage, the families' adapters, conversion), so it
sits here, below all of them.
"""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model being loaded."""

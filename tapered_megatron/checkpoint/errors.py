"""The error type of the tools that read checkpoints and exports (consolidation, export,
evaluation, generation); a leaf module."""


class ExportError(ValueError):
    """Bad input to the export / evaluation tools; the message says what and how to fix it."""

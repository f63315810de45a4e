"""The export and evaluation tools' error type (a leaf module: every export module raises it)."""


class ExportError(ValueError):
    """Bad input to the export / evaluation tools; the message says what and how to fix it."""

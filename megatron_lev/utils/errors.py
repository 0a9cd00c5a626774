"""The errors commands report as one line (the message names the flag, file or field)."""


class ConfigError(ValueError):
    """A bad flag, config value or combination; the message names the flag(s)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be converted; the message names the file or directory."""


class ExportError(CheckpointError):
    """A model, folder or tokenizer that cannot be converted; the message names it."""

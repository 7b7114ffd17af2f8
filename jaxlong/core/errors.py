"""The error every layer raises for a bad option: which option, what value, what would work."""


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or the combination of values is impossible."""

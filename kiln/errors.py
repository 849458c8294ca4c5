"""The error of a setting the model, checkpoint or machine cannot meet (the user's to fix), told
apart from a bug: the engine reports it in one line naming the flag, a bug with its traceback."""


class ConfigError(ValueError):
    """A setting, checkpoint or machine Kiln cannot run with; the message names the field or flag
    that fixes it. A ValueError, so callers that catch ValueError keep working."""


def is_user_error(e: BaseException) -> bool:
    """Whether `e` is the user's to fix (a refused setting, a missing file), so its traceback only
    helps debugging; any other error at start-up is a bug and is logged with its traceback."""
    return isinstance(e, (ConfigError, FileNotFoundError))

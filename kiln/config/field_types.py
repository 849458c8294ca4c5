"""Whether a value fits a config field's annotation (`int | None`, `bool`, `str`), as the
configs check what users pass: a bool is no int here (Python's is), an int is a float."""
import typing


def annotation_kinds(annotation) -> tuple:
    """`int | None` -> (int, NoneType); a plain `str` -> (str,)."""
    return typing.get_args(annotation) or (annotation,)


def fits(value, kind) -> bool:
    """`value` is a `kind` (one of annotation_kinds), bools apart from ints."""
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)

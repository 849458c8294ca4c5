"""The integers a request may carry to the engine core process (msgpack's are 64-bit), and the
check that finds one outside them anywhere in a request's data, naming where it lies."""
import dataclasses

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
_CONTAINERS = (list, tuple, set, frozenset, dict)
_SCALARS = frozenset({float, str, bool, type(None)})


def check_wire_ints(name: str, value) -> None:
    """Raise ValueError naming the place in `value` (the field `name`'s) that holds an int past
    64 bits: through lists, tuples, sets, dict keys and values, and dataclasses' fields. Past
    this the core client's encoder fails (OverflowError) as the request is handed over."""
    if type(value) in _SCALARS or (type(value) is int and INT64_MIN <= value <= INT64_MAX) \
            or (type(value) in _CONTAINERS and not value):
        return  # most of SamplingParams' fields: a verify() checks each
    _check(name, value)
    todo, seen = [(name, value)] if _nested(value) else [], set()
    while todo:  # a path is written only for a container or a value refused (a logit_bias
        path, v = todo.pop()  # of a whole vocabulary is one pass of comparisons)
        if id(v) in seen:  # a container holding itself
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            items = v.items()
            bad = next((k for k in v if isinstance(k, int) and not INT64_MIN <= k <= INT64_MAX),
                       None)
            if bad is not None:
                _check(f"{path} key", bad)
        elif isinstance(v, (list, tuple)):
            items = enumerate(v)
        elif isinstance(v, (set, frozenset)):
            items = ((None, item) for item in v)
        else:  # a dataclass
            items = ((f.name, getattr(v, f.name)) for f in dataclasses.fields(v))
        for where, item in items:
            if type(item) in _SCALARS:  # most items: nothing to check
                continue
            if isinstance(item, int):
                if not INT64_MIN <= item <= INT64_MAX:
                    _check(_where(path, v, where), item)
            elif _nested(item):
                todo.append((_where(path, v, where), item))


def _nested(v) -> bool:
    return isinstance(v, _CONTAINERS) or (dataclasses.is_dataclass(v)
                                          and not isinstance(v, type))


def _where(path: str, container, where) -> str:
    if isinstance(container, (set, frozenset)):
        return f"{path} item"
    if isinstance(container, (list, tuple)):
        return f"{path}[{where}]"
    if isinstance(container, dict):
        return f"{path}[{where!r}]"
    return f"{path}.{where}"


def _check(path: str, v) -> None:
    if isinstance(v, int) and not INT64_MIN <= v <= INT64_MAX:  # bools, IntEnums: in range
        raise ValueError(f"{path} must be within a 64-bit integer's range [{INT64_MIN}, "
                         f"{INT64_MAX}] (what crosses to the engine core), got {v}")

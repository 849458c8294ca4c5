"""The integers a request may carry to the engine core process (msgpack's are 64-bit), and the
check that finds one outside them anywhere in a request's data, naming where it lies; numpy's
numbers taken as the Python ones they equal (msgpack encodes only those)."""
import dataclasses
import enum
import numbers
import operator

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
_CONTAINERS = (list, tuple, set, frozenset, dict)
_SCALARS = frozenset({float, str, bool, type(None)})
_PLAIN = frozenset({int, float, bool})


def plain_number(value):
    """A numpy integer or float (any numbers.Real but Python's own) as the Python int or float
    it equals: np.int64(8) -> 8, as vLLM takes them; anything else (bools, enums, text, None)
    as it is, for the field's own check to judge."""
    if type(value) in _PLAIN or not isinstance(value, numbers.Real) \
            or isinstance(value, enum.Enum):
        return value
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    return float(value)


def plain_items(value):
    """A list / tuple's items (as a list), or a dict's keys and values, as plain_number makes
    them; the same object where all are Python's already (one pass over the types: a
    logit_bias may hold a whole vocabulary)."""
    if isinstance(value, (list, tuple)):
        if set(map(type, value)) <= _PLAIN:
            return value
        return list(map(plain_number, value))
    if isinstance(value, dict):
        if set(map(type, value)) <= _PLAIN and set(map(type, value.values())) <= _PLAIN:
            return value
        return {plain_number(k): plain_number(v) for k, v in value.items()}
    return value


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

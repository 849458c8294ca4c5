"""The integers a request may carry to the engine core process (msgpack's are 64-bit), and the
check that finds one outside them anywhere in a request's data, naming where it lies."""
import dataclasses

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


def check_wire_ints(name: str, value) -> None:
    """Raise ValueError naming the place in `value` (the field `name`'s) that holds an int past
    64 bits: through lists, tuples, sets, dict keys and values, and dataclasses' fields. Past
    this the core client's encoder fails (OverflowError) as the request is handed over."""
    todo, seen = [(name, value)], set()
    while todo:
        path, v = todo.pop()
        if isinstance(v, int):  # bools and IntEnums too: always in range
            if not INT64_MIN <= v <= INT64_MAX:
                raise ValueError(f"{path} must be within a 64-bit integer's range [{INT64_MIN}, "
                                 f"{INT64_MAX}] (what crosses to the engine core), got {v}")
            continue
        if not isinstance(v, (list, tuple, set, frozenset, dict)) \
                and not (dataclasses.is_dataclass(v) and not isinstance(v, type)):
            continue
        if id(v) in seen:  # a container holding itself
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            for key, item in v.items():
                todo.append((f"{path} key", key))
                todo.append((f"{path}[{key!r}]", item))
        elif isinstance(v, (list, tuple)):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
        elif isinstance(v, (set, frozenset)):
            todo.extend((f"{path} item", item) for item in v)
        else:
            todo.extend((f"{path}.{f.name}", getattr(v, f.name)) for f in dataclasses.fields(v))

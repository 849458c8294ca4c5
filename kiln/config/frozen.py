"""Configs are settings, frozen once resolved: `KilnConfig` freezes itself and its sub-configs
at the end of its resolution, so what an engine learns while it runs lives in its own state."""
import copy


class ConfigFrozenError(AttributeError):
    """A setting was assigned after its KilnConfig resolved it."""


def _refused(method: str):
    def refused(self, *args, **kwargs):
        raise ConfigFrozenError(f"{self.label} cannot be changed in place ({method}): configs "
                                f"are frozen once KilnConfig resolved them; build another "
                                f"config, or dataclasses.replace() this one")
    return refused


class FrozenList(list):
    """A resolved config's list (compile_sizes, custom_ops, ...): read as a list (JSON, ==,
    repr, so cache keys stay the same), refusing in-place changes, which a frozen config's
    assignment check never saw (and which ranks' copies shared)."""

    def __init__(self, items=(), label: str = "a config list"):
        super().__init__(items)
        self.label = label

    def __reduce__(self):  # list's own pickling appends item by item
        return type(self), (list(self), self.label)


class FrozenDict(dict):
    """A resolved config's dict (pass_config, inductor_compile_config, ...), as FrozenList."""

    def __init__(self, items=(), label: str = "a config dict"):
        super().__init__(items)
        self.label = label

    def __reduce__(self):
        return type(self), (dict(self), self.label)


for _cls in (FrozenList, FrozenDict):
    for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "__ior__", "append",
                  "extend", "insert", "pop", "popitem", "remove", "clear", "sort", "reverse",
                  "update", "setdefault"):
        if hasattr(_cls, _name):
            setattr(_cls, _name, _refused(_name))


def frozen_value(value, label: str):
    """`value` with its plain lists and dicts (nested ones too) made read-only."""
    if type(value) in (list, FrozenList):
        return FrozenList((frozen_value(v, f"{label}[]") for v in value), label)
    if type(value) in (dict, FrozenDict):
        return FrozenDict({k: frozen_value(v, f"{label}[{k!r}]") for k, v in value.items()},
                          label)
    return value


def thawed_value(value):
    """A plain, changeable copy of a frozen_value()."""
    if isinstance(value, list):
        return [thawed_value(v) for v in value]
    if isinstance(value, dict):
        return {k: thawed_value(v) for k, v in value.items()}
    return value


class FreezableConfig:
    """Mixin for the config dataclasses: assignment raises once `freeze()` ran."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise ConfigFrozenError(
                f"{type(self).__name__}.{name} cannot be set: configs are frozen once KilnConfig "
                f"resolved them (what the engine learns at run time is the worker's, model "
                f"runner's or engine core's state); build another config, or "
                f"dataclasses.replace() this one")
        if isinstance(value, (FrozenList, FrozenDict)):
            # a config not yet resolved (dataclasses.replace() of a resolved one, or one built
            # from its fields) takes its own changeable copy, as the error above advises
            value = thawed_value(value)
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if self.__dict__.get("_frozen"):
            raise ConfigFrozenError(f"{type(self).__name__}.{name} cannot be deleted: configs "
                                    f"are frozen once KilnConfig resolved them")
        object.__delattr__(self, name)

    def freeze(self) -> None:
        for name, value in list(self.__dict__.items()):
            if type(value) in (list, dict):
                object.__setattr__(self, name,
                                   frozen_value(value, f"{type(self).__name__}.{name}"))
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get("_frozen"))

    def thawed_copy(self):
        """A copy that can be resolved again (for a second KilnConfig given this one)."""
        clone = copy.copy(self)
        for name, value in list(clone.__dict__.items()):
            if isinstance(value, (FrozenList, FrozenDict)):
                object.__setattr__(clone, name, thawed_value(value))
        object.__setattr__(clone, "_frozen", False)
        return clone

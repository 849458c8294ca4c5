"""Configs are settings, frozen once resolved: `KilnConfig` freezes itself and its sub-configs
at the end of its resolution, so what an engine learns while it runs lives in its own state."""
import copy


class ConfigFrozenError(AttributeError):
    """A setting was assigned after its KilnConfig resolved it."""


class FreezableConfig:
    """Mixin for the config dataclasses: assignment raises once `freeze()` ran."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise ConfigFrozenError(
                f"{type(self).__name__}.{name} cannot be set: configs are frozen once KilnConfig "
                f"resolved them (what the engine learns at run time is the worker's, model "
                f"runner's or engine core's state); build another config, or "
                f"dataclasses.replace() this one")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if self.__dict__.get("_frozen"):
            raise ConfigFrozenError(f"{type(self).__name__}.{name} cannot be deleted: configs "
                                    f"are frozen once KilnConfig resolved them")
        object.__delattr__(self, name)

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get("_frozen"))

    def thawed_copy(self):
        """A copy that can be resolved again (for a second KilnConfig given this one)."""
        clone = copy.copy(self)
        object.__setattr__(clone, "_frozen", False)
        return clone

"""Engine configuration: one dataclass per concern, gathered in `KilnConfig`."""
from kiln.config.cache_config import CacheConfig
from kiln.config.compilation_config import CompilationConfig, CompilationMode
from kiln.config.device_config import DeviceConfig
from kiln.config.kiln_config import KilnConfig, get_current_kiln_config, set_current_kiln_config
from kiln.config.load_config import LoadConfig
from kiln.config.model_config import ModelConfig
from kiln.config.parallel_config import ParallelConfig
from kiln.config.scheduler_config import SchedulerConfig

__all__ = [
    "CacheConfig", "CompilationConfig", "CompilationMode", "DeviceConfig", "KilnConfig",
    "LoadConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig",
    "get_current_kiln_config", "set_current_kiln_config",
]

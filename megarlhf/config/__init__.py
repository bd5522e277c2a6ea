"""Configuration: every settings dataclass of a run, one module per section (model, data, parallel,
rollout, algorithm, preference, reward, train), composed in :class:`RunConfig` (:mod:`.schema`) and filled
from a YAML recipe and ``key.sub=value`` overrides by one generic loader (:mod:`.loader`); the resolved
config is saved next to the run. The package imports only :mod:`megarlhf.core`."""
from megarlhf.config.algorithm import AlgorithmConfig
from megarlhf.config.loader import (ConfigError, apply_override, from_dict, load_config, parse_override,
                                    save_config, to_dict)
from megarlhf.config.model import ModelConfig
from megarlhf.config.rollout import RolloutConfig
from megarlhf.config.schema import RunConfig
from megarlhf.config.train import CheckpointConfig, EvalConfig, LoggingConfig, OptimConfig, TrainConfig

__all__ = [
    "ConfigError", "apply_override", "from_dict", "load_config", "parse_override", "save_config", "to_dict",
    "AlgorithmConfig", "CheckpointConfig", "EvalConfig", "LoggingConfig", "ModelConfig", "OptimConfig",
    "RolloutConfig", "RunConfig", "TrainConfig",
]

"""Configuration: typed dataclasses (:mod:`.schema`) filled from a YAML recipe and ``key.sub=value``
overrides by one generic loader (:mod:`.loader`); the resolved config is saved next to the run."""
from megarlhf.config.loader import (ConfigError, apply_override, from_dict, load_config, parse_override,
                                    save_config, to_dict)
from megarlhf.config.algorithm import AlgorithmConfig
from megarlhf.config.train import CheckpointConfig, EvalConfig, LoggingConfig, OptimConfig, TrainConfig
from megarlhf.config.model import ModelConfig
from megarlhf.config.rollout import RolloutConfig
from megarlhf.config.schema import RunConfig

__all__ = [
    "ConfigError", "apply_override", "from_dict", "load_config", "parse_override", "save_config", "to_dict",
    "AlgorithmConfig", "CheckpointConfig", "EvalConfig", "LoggingConfig", "ModelConfig", "OptimConfig",
    "RolloutConfig", "RunConfig", "TrainConfig",
]

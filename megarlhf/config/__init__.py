"""Configuration: typed dataclasses (:mod:`.schema`) filled from a YAML recipe and ``key.sub=value``
overrides by one generic loader (:mod:`.loader`); the resolved config is saved next to the run."""
from megarlhf.config.loader import (ConfigError, apply_override, from_dict, load_config, parse_override,
                                    save_config, to_dict)
from megarlhf.config.schema import (AlgorithmConfig, CheckpointConfig, EvalConfig, LoggingConfig, ModelConfig,
                                    OptimConfig, RolloutConfig, RunConfig, TrainConfig)

__all__ = [
    "ConfigError", "apply_override", "from_dict", "load_config", "parse_override", "save_config", "to_dict",
    "AlgorithmConfig", "CheckpointConfig", "EvalConfig", "LoggingConfig", "ModelConfig", "OptimConfig",
    "RolloutConfig", "RunConfig", "TrainConfig",
]

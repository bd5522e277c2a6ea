"""Errors shared across megarlhf's layers (kept free of heavy imports so every layer can raise them).

:class:`UserError` and its subclasses are problems with what the user gave: a config key, a data file, a
checkpoint or model directory. Their message names the key or file and is the whole story, so the command
line prints it as one line. Every other exception is megarlhf's own failure and keeps its traceback.
"""


class UserError(ValueError):
    """A problem with the user's input; the message names the key, file or path and what is wrong."""


class ConfigError(UserError):
    """A bad config key or value; the message names the key path."""


class DataError(UserError):
    """A data file, row or field that cannot be used; the message names the file (and row) and the field."""


class CheckpointError(UserError):
    """A checkpoint (HF directory or Megatron distributed checkpoint) is missing, incomplete, incompatible
    with the model, or cannot be written; the message names the path and what is wrong."""


class EpisodeFailureBudgetError(UserError):
    """More multi-turn episodes ended in an error than ``rollout.env.failed_episodes_budget`` allows; the
    message gives the count, the budget and the first failures."""


class RewardsFailedError(UserError):
    """Every sample of a step failed its reward (a reward model that returned no finite score, a verifier
    that raised or timed out on all of them): training on ``reward.failure_reward`` alone would teach nothing."""

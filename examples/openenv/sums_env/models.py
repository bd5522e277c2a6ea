"""Data models of the sums environment."""
from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class SumsAction(Action):
    """The model's final answer, as it wrote it."""

    answer: str = Field(..., description="your final answer")


class SumsObservation(Observation):
    """Whether the answer was right."""

    feedback: str = Field(default="", description="what the environment says about the answer")

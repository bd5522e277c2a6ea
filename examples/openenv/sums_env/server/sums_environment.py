"""The sums environment: reset with the row's answer (megarlhf sends it as ``ground_truth``), one step scores
the model's answer."""
import re
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from sums_env.models import SumsAction, SumsObservation

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class SumsEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer: Optional[str] = None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              ground_truth: Optional[str] = None, **kwargs: Any) -> SumsObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._answer = ground_truth
        return SumsObservation(feedback="ready", done=False, reward=0.0)

    def step(self, action: SumsAction) -> SumsObservation:  # type: ignore[override]
        self._state.step_count += 1
        numbers = NUMBER.findall(action.answer)
        right = bool(numbers) and self._answer is not None and float(numbers[-1]) == float(self._answer)
        return SumsObservation(feedback="correct" if right else "wrong", done=True, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state

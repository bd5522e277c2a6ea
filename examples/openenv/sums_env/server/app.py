"""The sums environment's server: ``uvicorn sums_env.server.app:app --port 8011``."""
from openenv.core.env_server.http_server import create_app

from sums_env.models import SumsAction, SumsObservation
from sums_env.server.sums_environment import SumsEnvironment

app = create_app(SumsEnvironment, SumsAction, SumsObservation, env_name="sums_env", max_concurrent_envs=256)

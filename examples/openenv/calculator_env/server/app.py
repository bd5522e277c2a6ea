"""The calculator environment's server: ``uvicorn calculator_env.server.app:app --port 8012``."""
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

from calculator_env.server.calculator_environment import CalculatorEnvironment

app = create_app(CalculatorEnvironment, CallToolAction, CallToolObservation, env_name="calculator_env",
                 max_concurrent_envs=256)

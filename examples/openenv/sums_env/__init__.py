"""An OpenEnv environment that scores a final answer to an arithmetic question."""

"""An OpenEnv MCP environment with a calculator tool."""

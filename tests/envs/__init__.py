"""Package marker: gives these test modules names of their own (envs.test_api, envs.test_runner), which
other test folders also use as file names."""

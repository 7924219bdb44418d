"""The config's parts: YAML and overrides read (config_loader), one schema entry per key (config_schema, config_keys/),
cross-key checks (config_validation), and the pure-Python facts that the checks and the code share."""

"""The training core: the train state, the train step over the run's features, the step loop, where a run starts from,
evaluation, and what each entry point builds from the config (training_setup)."""

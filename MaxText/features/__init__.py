"""The optional training features, each one module behind MaxText/feature_protocol.py; selection.py picks a run's."""

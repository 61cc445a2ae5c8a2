"""A mesh worker that takes either role per request: python -m node."""

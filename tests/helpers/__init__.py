"""Code the test files share: tiny models (models.py), the CLI runners (cli.py), tiny tokenizers
(tokenizers.py). pytest fixtures stay in tests/conftest.py, built from these."""

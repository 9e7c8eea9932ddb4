"""entrenar: pretrain and fine-tune decoder-only LLMs, fast on a GPU and checked every run."""

__version__ = "0.1.0"

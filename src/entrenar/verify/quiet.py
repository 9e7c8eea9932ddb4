"""Silence the known, harmless noise that loading the transformers / peft oracle prints.

``entrenar verify --against hf`` printed, before its table, lines that are not about the user's model:
torchao probing optional CUDA extensions it cannot load on this host ("Failed to load .../torchao/_C_..."),
torch deprecating torchao's pytree registration of Enums (``torch/utils/_pytree.py``), and transformers'
"Loading weights" progress bar. Each is dropped by its logger (or warning category) and message, only
while the oracle is being built; anything else those libraries log or warn still shows.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

# (logger name, message pattern): exactly the records to drop.
NOISE = (
    ("torchao", re.compile(r"^Failed to load .*torchao[/\\]_C")),
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported by torch\.compile")),
)
# (category, message pattern) of Python warnings to drop.
WARNING_NOISE = ((FutureWarning, r"`is_gradient_checkpointing` is deprecated"),)


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """Drop the records in NOISE / WARNING_NOISE and transformers' progress bars inside the block."""
    filters = [(logging.getLogger(name), _Drop(pattern)) for name, pattern in NOISE]
    for logger, f in filters:
        logger.addFilter(f)
    bars = None
    try:
        with warnings.catch_warnings():
            for category, message in WARNING_NOISE:
                warnings.filterwarnings("ignore", message=message, category=category)
            import transformers.utils.logging as hf_logging  # torchao's messages come with this import

            bars = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        for logger, f in filters:
            logger.removeFilter(f)

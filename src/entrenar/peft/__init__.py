"""LoRA and QLoRA: adapter modules wrapped around frozen linears, NF4 base, PEFT-format save/load.

    lora.py        LoRALinear (the wrapper), apply_lora (injection, seeded init), merge math
    nf4_linear.py  NF4Linear: the frozen NF4 base of QLoRA
    io.py          PEFT-format adapter directories: save / read / load, is_adapter_dir
    identity.py    the base model's weights fingerprint recorded in the adapter note, checked at load
    lr.py          auto_lr: the rate ``--lr auto`` picks

Loading a model plus an adapter from a MODEL spec is ``load.py`` (load_model_with_adapter, load_any_model).
"""

from .identity import base_fingerprint, check_base_identity
from .io import (
    ADAPTER_CONFIG,
    ADAPTER_NOTE,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    adapter_path,
    adapter_state_dict,
    adapter_writer,
    is_adapter_dir,
    load_adapter,
    load_adapter_weights,
    read_adapter_config,
    save_adapter,
)
from .lora import (
    DEFAULT_TARGETS,
    ONTO,
    LoRALinear,
    adapters_disabled,
    apply_lora,
    base_weight,
    count_parameters,
    describe_parameters,
    linear_layer_names,
    lora_modules,
    merge_in_place,
    parse_targets,
    set_module,
)
from .lr import auto_lr
from .nf4_linear import NF4Linear

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_NOTE", "ADAPTER_WEIGHTS", "DEFAULT_TARGETS", "ONTO", "PEFT_PREFIX",
    "LoRALinear", "NF4Linear", "adapter_path", "adapter_state_dict", "adapter_writer", "adapters_disabled",
    "apply_lora", "auto_lr",
    "base_fingerprint", "base_weight", "check_base_identity", "count_parameters", "describe_parameters",
    "is_adapter_dir", "linear_layer_names", "load_adapter", "load_adapter_weights", "lora_modules",
    "merge_in_place", "parse_targets", "read_adapter_config", "save_adapter", "set_module",
]


"""entrenar: pretrain and fine-tune decoder-only LLMs, fast on a GPU and checked every run.

The Python API (entrenar/api.py, loaded on first use so that `import entrenar` stays light: no torch):
`entrenar.pretrain(...)`, `finetune`, `evaluate` (also `eval`), `generate` and `export_gguf` run the command of
that name with its flags as keyword arguments and return the `--json` result; failures raise `InputError` (exit
2) or `GuardError` (exit 3). `entrenar.evaluate` and `entrenar.generate` are also modules of the library
(entrenar/evaluate/, entrenar/generate.py): the import system binds those names to the modules, so the modules
themselves are made callable as the API's functions.
"""

import sys as _sys
import types as _types

from .errors import EntrenarError, GuardError, InputError

__version__ = "0.1.0"
__all__ = ["EntrenarError", "GuardError", "InputError", "eval", "evaluate", "export_gguf", "finetune", "generate",
           "pretrain"]
_API = ("pretrain", "finetune", "eval", "export_gguf")
_MODULE_API = ("evaluate", "generate")  # API names that are also modules of the package


class _CommandModule(_types.ModuleType):
    """A module named as an API function (entrenar.evaluate, entrenar.generate): calling it runs that function."""

    def __call__(self, **kwargs):
        return self._command()(**kwargs)

    @property
    def __signature__(self):
        return self._command().__signature__

    def _command(self):
        from . import api

        return getattr(api, self.__name__.rpartition(".")[2])


class _Package(_types.ModuleType):
    """`entrenar` itself: a submodule bound under an API name (by the import system) becomes callable."""

    def __setattr__(self, name, value):
        if name in _MODULE_API and isinstance(value, _types.ModuleType) and not isinstance(value, _CommandModule):
            value.__class__ = _CommandModule
        super().__setattr__(name, value)


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in _MODULE_API:  # importing the module binds it here (callable: _Package.__setattr__)
        import importlib  # not `from . import`: its fromlist asks this __getattr__ again

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'entrenar' has no attribute {name!r}")


_sys.modules[__name__].__class__ = _Package
for _name in _MODULE_API:  # those imported already (none, unless a submodule imported them while this ran)
    if _name in vars(_sys.modules[__name__]):
        setattr(_sys.modules[__name__], _name, vars(_sys.modules[__name__])[_name])

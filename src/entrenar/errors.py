"""Errors with exit codes from the command-line contract (docs/design.md, "Command line").

InputError (exit 2): the user's input is wrong; the message names the file and the problem.
GuardError (exit 3): a named guard stopped the run. Guards that judge the input before training
starts exit 2 like any bad input: GUARD-LOAD (checkpoint tensors vs model) and GUARD-DATA (the data
set cannot train what the user thinks). `entrenar.cli` turns each into its exit code and, under
--json, into {"ok": false, "error": str(e), "guard": guard_id, "exit_code": ...}.
"""

from __future__ import annotations


class EntrenarError(Exception):
    exit_code = 1


class InputError(EntrenarError, ValueError):
    """Bad input: a missing file, a malformed checkpoint, an unknown name. Exit 2."""

    exit_code = 2


class GuardError(EntrenarError):
    """A named guard fired. ``str()`` is 'GUARD-ID: cause. Remedy: ...'."""

    exit_code = 3

    def __init__(self, guard_id: str, cause: str, remedy: str = "", exit_code: int | None = None,
                 details: dict | None = None):
        self.guard_id, self.cause, self.remedy = guard_id, cause, remedy
        self.details = details or {}
        if exit_code is not None:
            self.exit_code = exit_code
        super().__init__(f"{guard_id}: {cause}" + (f" Remedy: {remedy}" if remedy else ""))


class LoadError(GuardError, ValueError):
    """GUARD-LOAD: checkpoint tensors and model disagree. Bad input, so exit 2."""

    def __init__(self, cause: str, remedy: str = "", details: dict | None = None):
        super().__init__("GUARD-LOAD", cause, remedy, exit_code=2, details=details)


EXIT_OUT_OF_MEMORY = 5

_MEMORY_REMEDY = {
    "finetune": "lower --batch-size or --max-seq-len and keep the batch with --grad-accum (GRPO: --batch-size x "
                "--num-generations sequences go through one forward), or train less in memory: --mode lora/qlora, "
                "a bf16 --dtype; `--resume auto` continues from the run's last complete checkpoint",
    "pretrain": "lower --batch-size or --seq-len and keep the batch with --grad-accum, or a bf16 --dtype; "
                "`--resume auto` continues from the run's last complete checkpoint",
    "eval": "give --batch-size N below the slots `auto` chose (its log line says how many), or a smaller "
            "--max-new-tokens",
    "generate": "a shorter prompt or --max-new-tokens, or --device cpu",
}


def out_of_memory_message(command: str, error: BaseException) -> str:
    """What `entrenar COMMAND` prints when the device ran out of memory (exit EXIT_OUT_OF_MEMORY): the allocator's
    first line, then what to lower for this command."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    remedy = _MEMORY_REMEDY.get(command, "give the command less to hold at once (a smaller batch or sequence)")
    return f"out of device memory ({first}). Remedy: {remedy}"

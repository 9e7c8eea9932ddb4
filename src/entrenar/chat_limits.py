"""Bounds on rendering a chat template: time, output size, no other templates (issue 28 items 6, 7).

A chat template is code that ships with a model. The jinja sandbox stops it from reaching Python
internals, but not from running forever: nested ``range(99999)`` loops made `generate --chat` hang, and a
loop that writes made it grow without end; ``{% include %}`` was a TypeError traceback; ``range(100000000)``
(the sandbox's OverflowError) and a macro calling itself (RecursionError) were exit 1. A render is
stopped, as an InputError (exit 2) naming the bound and the remedy, when it runs longer than
``RENDER_SECONDS``, writes more than ``MAX_RENDER_CHARS`` plus 4x the messages' own text, asks for a range
past the sandbox's bound or recurses without end. A real
template renders a chat in milliseconds and writes little more than the messages.

Time is bounded by SIGALRM where it exists (the main thread, POSIX): it interrupts a loop that writes
nothing. Elsewhere the clock is checked between the pieces the template writes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from .errors import InputError

RENDER_SECONDS = 10.0
MAX_RENDER_CHARS = 1 << 24  # 16 Mi characters (a 128k-token chat is ~0.5 M)
_REMEDY = "fix the template (tokenizer_config.json chat_template / chat_template.jinja) or run without --chat"


class _TooLong(Exception):
    """Raised by the alarm inside the template's code; becomes an InputError outside it."""


def no_include_loader() -> Any:
    """A jinja loader that refuses every other template: a chat template must be self-contained."""
    import jinja2

    class NoIncludes(jinja2.BaseLoader):
        def get_source(self, environment: Any, template: str) -> Any:
            raise jinja2.TemplateNotFound(f"{template} (a chat template may not include, import or extend "
                                          f"other templates)")

    return NoIncludes()


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[bool]:
    """Raise _TooLong in this thread after ``seconds``; yields whether the alarm is armed."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield False
        return

    def fire(signum: int, frame: Any) -> None:
        raise _TooLong

    previous = signal.signal(signal.SIGALRM, fire)
    outer = signal.setitimer(signal.ITIMER_REAL, seconds)[0]  # someone else's alarm: restored below
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - seconds, 1e-3))


def bounded_render(template: Any, context: dict[str, Any], where: str, input_chars: int) -> str:
    """``template.render(**context)``, stopped (InputError) past RENDER_SECONDS or the size bound."""
    limit_s, max_chars = RENDER_SECONDS, MAX_RENDER_CHARS + 4 * input_chars
    too_long = InputError(f"{where}: the chat template ran longer than {limit_s:g} s on these messages "
                          f"(a loop without end?); {_REMEDY}")
    deadline = time.monotonic() + limit_s
    parts: list[str] = []
    size = 0
    try:
        with _alarm(limit_s):
            for piece in template.generate(**context):
                parts.append(piece)
                size += len(piece)
                if size > max_chars:
                    raise InputError(f"{where}: the chat template wrote more than {max_chars:,} characters for "
                                     f"messages of {input_chars:,}; {_REMEDY}")
                if time.monotonic() > deadline:
                    raise too_long
    except _TooLong:
        raise too_long from None
    except OverflowError as e:  # the sandbox's `range` bound (MAX_RANGE): range(100000000) in the template
        raise InputError(f"{where}: the chat template asked for more than the sandbox allows ({e}); {_REMEDY}") \
            from None
    except RecursionError:  # a macro that calls itself without end
        raise InputError(f"{where}: the chat template recursed without end (a macro calling itself?); "
                         f"{_REMEDY}") from None
    return "".join(parts)

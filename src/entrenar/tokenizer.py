"""Tokenizers from an HF directory (tokenizer.json) or from GGUF metadata, plus chat templates.

A GGUF has no tokenizer.json: it stores the byte-level BPE vocabulary, merges and token types
under llama.cpp's keys. We rebuild a `tokenizers.Tokenizer` from them with the pre-tokenizer
that ``tokenizer.ggml.pre`` names (the split the merges were learned with); an unknown value is
an InputError, never a silent fallback to GPT-2's split.

Control tokens (``<|im_start|>``, ``<|im_end|>``...) are special added tokens, so they are
matched whole and never split. BOS is added only when the metadata says so
(``tokenizer.ggml.add_bos_token`` / ``add_bos_token``). A chat is rendered once with the model's
own jinja template and tokenized once: BOS is prepended only if the add-BOS flag is set and the
template did not already write it, so there are never two.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .errors import InputError

# ---- pre-tokenizers by tokenizer.ggml.pre -------------------------------------------------
# The regexes are llama.cpp's (src/llama-vocab.cpp) and the models' own tokenizer.json splits.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _pre_gpt2() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is GPT-2's: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _pre_smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM2's tokenizer.json and llama.cpp's SMOLLM: every digit is its own piece, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# name -> (pre-tokenizer factory, BPE ignore_merges). llama.cpp sets ignore_merges for LLaMA-3
# (a word that is itself a token is taken whole), as LLaMA-3's tokenizer.json does.
GGUF_PRE_TOKENIZERS: dict[str, tuple[Any, bool]] = {
    "gpt2": (_pre_gpt2, False),
    "smollm": (_pre_smollm, False),
    "qwen2": (lambda: _split_then_bytes(QWEN2_SPLIT), False),
    "llama-bpe": (lambda: _split_then_bytes(LLAMA3_SPLIT), True),
    "llama3": (lambda: _split_then_bytes(LLAMA3_SPLIT), True),
    "llama-v3": (lambda: _split_then_bytes(LLAMA3_SPLIT), True),
    # LLaMA-3's split with merges always applied (llama.cpp's SMAUG/DBRX): what `tokenizer train` makes
    "smaug-bpe": (lambda: _split_then_bytes(LLAMA3_SPLIT), False),
}

# llama.cpp token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# End-of-turn tokens of common chat formats, tried in order when the metadata names none.
EOT_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (byte-level BPE spells every token with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"),
                                                                                              ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_TO_UNICODE = _bytes_to_unicode()
BYTE_ALPHABET = frozenset(BYTE_TO_UNICODE.values())


# ---- results ------------------------------------------------------------------------------
@dataclass
class RenderedChat:
    text: str
    # (start_char, end_char) of each assistant message's content through its end-of-turn token
    assistant_spans: list[tuple[int, int]]


@dataclass
class EncodedChat:
    ids: list[int]
    assistant_mask: list[bool]  # True on tokens of assistant spans (incl. the end-of-turn token)


# ---- chat template environment --------------------------------------------------------------
def _template_env():
    """Sandboxed jinja2 environment with transformers' settings and helpers."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes; chat templates expect plain JSON (as transformers renders)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) renders its
        body unchanged; spans come from the message contents either way."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    from .chat_limits import no_include_loader

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=no_include_loader(),
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# ---- the tokenizer --------------------------------------------------------------------------
class ChatTokenizer:
    """A `tokenizers.Tokenizer` with the model's special tokens, BOS rule and chat template."""

    def __init__(self, tokenizer: Tokenizer, *, bos_token: str | None, eos_token: str | None,
                 pad_token: str | None = None, unk_token: str | None = None, eot_token: str | None = None,
                 add_bos: bool = False, chat_template: str | None = None, source: str = ""):
        self.source = source
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        if eot_token is None:
            eot_token = next((t for t in EOT_CANDIDATES if tokenizer.token_to_id(t) is not None), eos_token)
        self.eot_token = eot_token
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.tokenizer = tokenizer
        self.bos_id = self._id_in(tokenizer, bos_token)
        self.eos_id = self._id_in(tokenizer, eos_token)
        self.eot_id = self._id_in(tokenizer, eot_token)
        self.pad_id = self._id_in(tokenizer, pad_token)
        self.unk_id = self._id_in(tokenizer, unk_token)
        if self.add_bos and self.bos_id is None:
            raise InputError(f"{source}: the tokenizer says to add BOS but names no BOS token that is in "
                             f"its vocabulary; fix bos_token in its metadata")
        self._set_post_processor()
        # Offsets for assistant masks come from a copy without post-processing: a ByteLevel
        # post-processor trims whitespace out of offsets, which would drop "\n" tokens from a span.
        self._offsets_tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
        self._offsets_tokenizer.post_processor = None
        self._template = None
        self.chat_template_source = source  # where the template came from: the model, or --chat-template FILE

    @staticmethod
    def _id_in(tokenizer: Tokenizer, token: str | None) -> int | None:
        return None if token is None else tokenizer.token_to_id(token)

    def _set_post_processor(self) -> None:
        """BOS prepended by the tokenizer itself iff add_bos, so tokenizer.json carries the rule."""
        if self.add_bos:
            self.tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A {self.bos_token} $B",
                special_tokens=[(self.bos_token, self.bos_id)])
        elif _adds_tokens(self.tokenizer):
            self.tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")

    # -- basics
    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return (f"ChatTokenizer({self.source!r}, len={len(self)}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"eot={self.eot_token!r}, add_bos={self.add_bos})")

    @property
    def stop_ids(self) -> set[int]:
        """Token ids that end generation: EOS and end-of-turn."""
        return {i for i in (self.eos_id, self.eot_id) if i is not None}

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; BOS first only when add_special and the model adds BOS."""
        return self.tokenizer.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def check_ids(self, ids: Sequence[int], vocab_size: int) -> None:
        """InputError if any id is outside [0, vocab_size) -- before it can index an embedding."""
        bad = [i for i in ids if not 0 <= int(i) < vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is out of range for the model's vocab_size {vocab_size} "
                             f"({len(bad)} such ids; tokenizer {self.source!r} has {len(self)} tokens); "
                             f"use the tokenizer that belongs to this model")

    # -- chat
    def set_chat_template(self, template: str, source: str) -> None:
        """Use ``template`` (e.g. `--chat-template FILE`) instead of the model's; it must compile."""
        import jinja2

        try:
            compiled = _template_env().from_string(template)
        except jinja2.TemplateError as e:
            raise InputError(f"{source}: the chat template does not compile: {e}") from e
        self.chat_template, self._template, self.chat_template_source = template, compiled, source

    def supports_tools(self) -> bool:
        """Whether the chat template renders tools: it reads the `tools` variable and messages' `tool_calls`
        (a template that does neither would drop schemas and calls from the text without a word)."""
        return _template_supports_tools(self.chat_template or "")

    def _check_tool_support(self, messages: list[dict[str, Any]], tools: Any) -> None:
        uses_tools = bool(tools) or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                        for m in messages)
        if uses_tools and not self.supports_tools():
            raise InputError(f"the chat template of {self.chat_template_source} does not support tools (it never "
                             f"uses the `tools` variable and `tool_calls`), so tool schemas, calls and results "
                             f"would be left out of the text; pass a template that renders them: "
                             f"--chat-template chatml_tools (packaged, for ChatML models such as SmolLM2 and "
                             f"Qwen2.5) or --chat-template FILE, or remove the tools from the data")

    def _compiled_template(self):
        if self.chat_template is None:
            raise InputError(f"{self.source}: the model has no chat template (no tokenizer.chat_template in "
                             f"the GGUF, no chat_template in tokenizer_config.json); run without --chat")
        if self._template is None:
            import jinja2

            try:
                self._template = _template_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise InputError(f"{self.chat_template_source}: the chat template does not compile: {e}") from e
        return self._template

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    tools: list[dict[str, Any]] | None = None) -> RenderedChat:
        """The chat as the model's template writes it (``tools``: function schemas, passed to the template as
        transformers does), with each assistant message's char span."""
        import jinja2

        _check_messages(messages, self.source)
        template = self._compiled_template()
        self._check_tool_support(messages, tools)
        try:
            text = self._render(template, messages, add_generation_prompt, tools)
        except jinja2.TemplateError as e:  # includes raise_exception(...) from the template
            # the template's source, not the model's (issue 38 item 10: a --chat-template FILE's failure was
            # reported against the model's GGUF)
            raise InputError(f"the chat template of {self.chat_template_source} failed on these messages: {e}") from e
        return RenderedChat(text, self._assistant_spans(text, messages, template, tools))

    def _assistant_spans(self, text: str, messages: list[dict[str, Any]], template: Any,
                         tools: list[dict[str, Any]] | None = None) -> list[tuple[int, int]]:
        """Find each message's content in order; an assistant span runs through the next end-of-turn.

        An assistant answer is searched for only after the rendering of the conversation before it
        plus the generation prompt (its own header): a plain search from the previous message would
        find a short answer ("b", "a") inside the template's default system prompt or a header.
        A turn with tool calls is located by rendering (``_tool_turn_span``).
        """
        spans, cursor = [], 0
        for i, msg in enumerate(messages):
            content = msg.get("content") or ""
            if not isinstance(content, str):
                continue  # structured content: the template decides; no span can be located
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                spans.append(self._tool_turn_span(text, messages, i, template, tools))
                cursor = spans[-1][1]
                continue
            if msg.get("role") == "assistant":
                prefix = self._render_prefix(template, messages[:i], tools)
                if prefix is not None and text.startswith(prefix):
                    cursor = max(cursor, len(prefix))
            start = text.find(content, cursor)
            if start < 0 and content.strip():
                content = content.strip()  # templates that `| trim` the content
                start = text.find(content, cursor)
            if start < 0:
                if msg.get("role") == "tool" and content.strip():
                    raise InputError(f"the chat template of {self.chat_template_source} does not write tool result "
                                     f"message {i} (its content is not in the rendered chat); pass a template that "
                                     f"renders `tool` messages with --chat-template FILE")
                if msg.get("role") != "assistant":
                    continue  # a template may drop or rewrite other messages; only answers need a span
                raise InputError(f"the chat template of {self.chat_template_source} does not write assistant "
                                 f"message {i} verbatim, so its span (the loss mask) cannot be located; the "
                                 f"template rewrites assistant content")
            end = start + len(content)
            cursor = end
            if msg.get("role") == "assistant":
                if self.eot_token:
                    eot = text.find(self.eot_token, end)
                    nxt = _next_content_start(text, messages[i + 1:], end)
                    if eot >= 0 and (nxt is None or eot < nxt):
                        end = eot + len(self.eot_token)
                        cursor = end
                spans.append((start, end))
        return spans

    def _tool_turn_span(self, text: str, messages: list[dict[str, Any]], i: int, template: Any,
                        tools: list[dict[str, Any]] | None) -> tuple[int, int]:
        """An assistant turn with tool calls: from its content (or, without content, from the end of the
        generation prompt) through the last end-of-turn the turn writes. Found by rendering the history with
        the generation prompt and the history with this turn, so call text (JSON, names) is never searched
        for in the rest of the chat."""
        import jinja2

        prefix = self._render_prefix(template, messages[:i], tools)
        try:
            upto = self._render(template, messages[:i + 1], False, tools)
        except jinja2.TemplateError:
            upto = None
        where = f"the chat template of {self.chat_template_source}"
        if prefix is None or upto is None or not (text.startswith(upto) and upto.startswith(prefix)):
            raise InputError(f"{where} renders the chat before assistant message {i} differently once the "
                             f"message is added, so its tool calls (the loss mask) cannot be located; pass a "
                             f"template whose rendering of a conversation starts with that of its history "
                             f"(--chat-template FILE)")
        content = messages[i].get("content") or ""
        start = upto.find(content, len(prefix)) if content else len(prefix)
        end = upto.rfind(self.eot_token) if self.eot_token else -1
        if start < 0 or end < start:
            raise InputError(f"{where} does not write assistant message {i}'s content and an end-of-turn "
                             f"{self.eot_token!r} after it; its loss mask cannot be located")
        end += len(self.eot_token)
        at = start
        for call in messages[i]["tool_calls"]:
            name = (call.get("function") or call).get("name", "")
            at = text.find(name, at, end)
            if not name or at < 0:
                raise InputError(f"{where} does not write the tool call {name!r} of assistant message {i}; "
                                 f"pass a template that renders `tool_calls` (--chat-template FILE)")
            at += len(name)
        return start, end

    def _render(self, template: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        from .chat_limits import bounded_render

        context = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "pad_token": self.pad_token or "", "unk_token": self.unk_token or ""}
        chars = sum(len(m.get("content") or "") for m in messages if isinstance(m.get("content"), str))
        if tools is not None:
            context["tools"] = tools  # as transformers' apply_chat_template(tools=...) passes them
        if tools or any(m.get("tool_calls") for m in messages):  # their JSON is text the template writes too
            chars += len(json.dumps(tools)) + len(json.dumps([m.get("tool_calls") for m in messages]))
        return bounded_render(template, context, self.chat_template_source, chars)  # time and size bounded (exit 2)

    def _render_prefix(self, template: Any, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> str | None:
        """The text a template writes before an assistant turn: the history plus the generation prompt."""
        import jinja2

        try:
            return self._render(template, messages, True, tools)
        except jinja2.TemplateError:
            return None  # e.g. a template that refuses a history not ending with a user turn

    def prepends_bos(self, rendered: str) -> bool:
        """Whether a rendered chat needs BOS in front: only if the model adds BOS and the template
        did not already write it (so never two)."""
        return self.add_bos and not rendered.startswith(self.bos_token)

    def _ids_and_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._offsets_tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = list(enc.ids), list(enc.offsets)
        if self.prepends_bos(text):
            ids, offsets = [self.bos_id] + ids, [(0, 0)] + offsets
        return ids, offsets

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of an already-rendered chat: one BOS at most (the template's or the add-BOS rule's)."""
        return self._ids_and_offsets(text)[0]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    tools: list[dict[str, Any]] | None = None) -> EncodedChat:
        """Render once, tokenize once; mask True on tokens overlapping an assistant span."""
        rendered = self.render_chat(messages, add_generation_prompt, tools)
        ids, offsets = self._ids_and_offsets(rendered.text)
        mask = [False] * len(ids)
        spans = rendered.assistant_spans
        k = 0
        for t, (a, b) in enumerate(offsets):
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            if k < len(spans) and b > a and a < spans[k][1] and b > spans[k][0]:
                mask[t] = True
        return EncodedChat(ids, mask)

    # -- saving
    def save_hf(self, out_dir: str | os.PathLike) -> Path:
        """tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer loads to the same ids."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(out / "tokenizer.json"))
        added = {}
        for idx, tok in sorted(self.tokenizer.get_added_tokens_decoder().items()):
            added[str(idx)] = {"content": tok.content, "lstrip": tok.lstrip, "normalized": tok.normalized,
                               "rstrip": tok.rstrip, "single_word": tok.single_word, "special": tok.special}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        special_map = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                         ("pad_token", self.pad_token), ("unk_token", self.unk_token))
                       if v is not None}
        (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
        return out


@functools.lru_cache(maxsize=8)
def _template_supports_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        variables = meta.find_undeclared_variables(_template_env().parse(template))
    except jinja2.TemplateError:
        return False
    return "tools" in variables and "tool_calls" in template


def _adds_tokens(tokenizer: Tokenizer) -> bool:
    return tokenizer.post_processor is not None and len(tokenizer.encode("a", add_special_tokens=True).ids) != len(
        tokenizer.encode("a", add_special_tokens=False).ids)


def _next_content_start(text: str, rest: list[dict[str, Any]], cursor: int) -> int | None:
    for msg in rest:
        content = msg.get("content")
        if isinstance(content, str) and content:
            pos = text.find(content, cursor)
            return pos if pos >= 0 else None
    return None


def _check_messages(messages: Any, source: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{source}: a chat needs a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InputError(f"{source}: message {i} must be a dict with 'role' and 'content', got {m!r}")


# ---- loading ----------------------------------------------------------------------------------
PACKAGED_TEMPLATES = ("chatml_tools", "qwen2_tools_json")  # templates/NAME.jinja, shipped with the package


def packaged_template(spec: str | os.PathLike) -> str | None:
    """The text of the packaged chat template `spec` names (`chatml_tools`, or `chatml_tools.jinja`), when `spec`
    is such a name and no file of that name is there (a file given by path wins); else None."""
    name = str(spec).removesuffix(".jinja")
    if name not in PACKAGED_TEMPLATES or Path(spec).exists():
        return None
    from importlib.resources import files

    return files("entrenar").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def use_chat_template_file(tokenizer: ChatTokenizer, path: str | os.PathLike | None) -> None:
    """`--chat-template FILE|NAME`: render chats with that template instead of the model's (exit 2 if unreadable);
    NAME is a packaged template (PACKAGED_TEMPLATES), so an installed package needs no source-tree path."""
    if path is None:
        return
    packaged = packaged_template(path)
    if packaged is not None:
        tokenizer.set_chat_template(packaged, f"--chat-template {path} (packaged)")
        return
    from .fileio import regular_file_problem

    file = Path(path)
    try:
        file_check = regular_file_problem(file)  # a FIFO would block the read for ever
        if file_check is not None:
            raise OSError(file_check)
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--chat-template {file}: cannot read the template ({e}); give a jinja chat template "
                         f"file or a packaged template's name ({', '.join(PACKAGED_TEMPLATES)})") from e
    tokenizer.set_chat_template(text, f"--chat-template {file}")


def load_tokenizer(spec: str | os.PathLike | ChatTokenizer) -> ChatTokenizer:
    """ChatTokenizer for a MODEL spec: packaged name, .gguf file, HF dir (tokenizer.json), run dir."""
    if isinstance(spec, ChatTokenizer):
        return spec
    path = Path(str(spec))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return load_hf_tokenizer(path)
    if path.is_dir() and (path / "final" / "tokenizer.json").is_file():
        return load_hf_tokenizer(path / "final")
    from .model_spec import resolve_model

    resolved = resolve_model(spec)
    if resolved.is_file():
        return load_gguf_tokenizer(resolved)
    return load_hf_tokenizer(resolved)


def _token_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):  # {"content": ..., "__type": "AddedToken"}
        return value.get("content")
    raise InputError(f"special token entry {value!r} is neither a string nor an AddedToken dict")


def load_hf_tokenizer(path: str | os.PathLike) -> ChatTokenizer:
    """From an HF directory: tokenizer.json, tokenizer_config.json, chat_template.jinja if present."""
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise InputError(f"{path}: no tokenizer.json (only fast tokenizers are supported); save the "
                         f"tokenizer with transformers' save_pretrained or convert the model from its GGUF")
    try:
        tokenizer = Tokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise InputError(f"{tj}: not a readable tokenizer.json: {e}") from e
    config: dict[str, Any] = {}
    cfg_path = path / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{cfg_path}: line {e.lineno}: invalid JSON: {e.msg}") from e
    special_map: dict[str, Any] = {}
    sm_path = path / "special_tokens_map.json"
    if sm_path.is_file():
        special_map = json.loads(sm_path.read_text())

    def special(name: str) -> str | None:
        return _token_str(config.get(name, special_map.get(name)))

    chat_template = config.get("chat_template")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        chat_template = jinja_file.read_text()
    if isinstance(chat_template, list):  # named templates: use "default"
        named = {t["name"]: t["template"] for t in chat_template}
        chat_template = named.get("default")
    bos = special("bos_token")
    # add_bos: the config's flag, else whatever the tokenizer.json post-processor already does.
    if "add_bos_token" in config:
        add_bos = bool(config["add_bos_token"])
    else:
        bos_id = tokenizer.token_to_id(bos) if bos else None
        with_special = tokenizer.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(with_special) and with_special[0] == bos_id
    return ChatTokenizer(tokenizer, bos_token=bos, eos_token=special("eos_token"), pad_token=special("pad_token"),
                         unk_token=special("unk_token"), add_bos=add_bos, chat_template=chat_template,
                         source=str(path))


def read_gguf_tokenizer_fields(path: str | os.PathLike) -> dict[str, Any]:
    """The tokenizer.* metadata of a GGUF file as plain Python values (the model loader's header parser)."""
    from .gguf_file import open_reader

    return {k: v for k, v in open_reader(path).fields.items() if k.startswith("tokenizer.")}


_GGUF_META_CACHE: dict[tuple[str, int, int], dict[str, Any]] = {}


def load_gguf_tokenizer(path: str | os.PathLike) -> ChatTokenizer:
    """Byte-level BPE tokenizer from GGUF metadata (tokenizer.ggml.model = gpt2)."""
    path = Path(path).resolve()
    st = path.stat()
    # the metadata of an unchanged file is parsed once per process (tests and commands reload often)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _GGUF_META_CACHE:
        while len(_GGUF_META_CACHE) >= 4:  # a few models' metadata (~30 MB each at most)
            _GGUF_META_CACHE.pop(next(iter(_GGUF_META_CACHE)))
        _GGUF_META_CACHE[key] = read_gguf_tokenizer_fields(path)
    return tokenizer_from_gguf_metadata(_GGUF_META_CACHE[key], str(path))


def tokenizer_from_gguf_metadata(meta: dict[str, Any], source: str) -> ChatTokenizer:
    model_type = meta.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise InputError(f"{source}: tokenizer.ggml.model is {model_type!r}; only 'gpt2' (byte-level BPE) "
                         f"vocabularies are supported; convert the model with its tokenizer.json instead")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise InputError(f"{source}: tokenizer.ggml.pre is {pre!r}, which entrenar does not know; the "
                         f"pre-tokenizer decides how text is split before BPE, and guessing it gives wrong ids. "
                         f"Supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise InputError(f"{source}: the GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise InputError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for idx, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            # Kept as written: the added-token matcher finds them in raw text before BPE runs.
            added.append(AddedToken(tok, special=kind == TOKEN_CONTROL, normalized=False))
            vocab[tok] = idx
        elif set(tok) <= BYTE_ALPHABET:
            vocab[tok] = idx
        else:  # a token stored as plain UTF-8: spell it in the byte alphabet like the others
            vocab["".join(BYTE_TO_UNICODE[b] for b in tok.encode("utf-8"))] = idx
    pairs = []
    for line, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2:
            raise InputError(f"{source}: tokenizer.ggml.merges[{line}] = {m!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    make_pre, ignore_merges = GGUF_PRE_TOKENIZERS[pre]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()
    if added:
        tokenizer.add_tokens(added)
    count = tokenizer.get_vocab_size(with_added_tokens=True)
    assert count == len(tokens), f"{source}: built {count} tokens from {len(tokens)} (duplicate tokens?)"

    def token_at(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        if idx is None:
            return None
        if not 0 <= int(idx) < len(tokens):
            raise InputError(f"{source}: tokenizer.ggml.{key} = {idx} is outside the {len(tokens)}-token vocabulary")
        return tokens[int(idx)]

    return ChatTokenizer(tokenizer, bos_token=token_at("bos_token_id"), eos_token=token_at("eos_token_id"),
                         pad_token=token_at("padding_token_id"), unk_token=token_at("unknown_token_id"),
                         eot_token=token_at("eot_token_id"),
                         add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                         chat_template=meta.get("tokenizer.chat_template"), source=source)


# ---- the tokenizer files that travel with shards and checkpoints -----------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def encoding_sha256(tokenizer: Any) -> str | None:
    """sha256 of what decides the ids of a text: normalizer, pre-tokenizer, model (vocabulary and
    merges) and added tokens -- not the post-processor or the decoder. Two tokenizers with the same
    value encode every text the same way (a GGUF-built tokenizer and its saved tokenizer.json agree)."""
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    if not hasattr(inner, "to_str"):
        return None
    d = json.loads(inner.to_str())
    added = sorted((t["id"], t["content"], bool(t.get("special"))) for t in d.get("added_tokens") or [])
    key = {"normalizer": d.get("normalizer"), "pre_tokenizer": d.get("pre_tokenizer"), "model": d.get("model"),
           "added_tokens": added}
    return hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def save_tokenizer_files(source: Any, out_dir: str | os.PathLike) -> dict[str, str]:
    """Write a tokenizer's files into ``out_dir``; return {file name: sha256}.

    ``source`` is a ChatTokenizer (its save_hf), a directory holding tokenizer files (copied), or an
    object with a ``tokenizers.Tokenizer`` in ``.tokenizer`` and bos_id/eos_id (tokenizer.json plus
    a tokenizer_config.json naming BOS/EOS, so load_tokenizer gets them back).
    """
    import shutil

    from .fileio import sha256_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(source, (str, os.PathLike)):
        src = Path(source)
        if not (src / "tokenizer.json").is_file():
            raise InputError(f"{src}: no tokenizer.json to copy")
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
                shutil.copyfile(src / name, out / name)
    elif hasattr(source, "save_hf"):
        source.save_hf(out)
    else:
        inner = getattr(source, "tokenizer", None)
        if inner is None or not hasattr(inner, "save"):
            raise InputError(f"cannot save tokenizer files of {type(source).__name__}: it has no tokenizers.Tokenizer")
        inner.save(str(out / "tokenizer.json"))

        def token(idx: Any) -> str | None:
            return None if idx is None else inner.id_to_token(int(idx))

        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(getattr(source, "bos_id", None)),
                  "eos_token": token(getattr(source, "eos_id", None)),
                  "pad_token": token(getattr(source, "pad_id", None)),
                  "add_bos_token": bool(getattr(source, "add_bos", False)), "clean_up_tokenization_spaces": False}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return {name: sha256_file(out / name) for name in TOKENIZER_FILES if (out / name).is_file()}

"""`entrenar generate` and `entrenar merge`: the command-line faces of `generate.py` and `merge.py`.

Those two stay plain library code; argument parsing, printing and the result dict live here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..data.sft import CHAT_TEMPLATE_HELP
from ..devices import DTYPES, WEIGHT_DTYPES
from ..errors import InputError
from ..generate import DEFAULT_MAX_NEW_TOKENS
from ..merge import ONTO
from .registry import add_command, add_device_option


# ---- generate ------------------------------------------------------------------------------------
def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """Arguments that change which weights generate runs (e.g. a LoRA adapter) go here."""
    p.add_argument("--adapter", default=None,
                   help="LoRA/QLoRA adapter directory (PEFT format, or a LoRA run) applied on --model unmerged "
                        "(none)")
    p.add_argument("--force-base", action="store_true", help="apply --adapter even if MODEL is not the base it recorded (exit 2 otherwise)")




def load_generation_model(args: argparse.Namespace, device: str) -> Any:
    """The model to generate with, in the weights dtype --dtype resolves to on `device` (bf16 weights on a
    GPU with native bf16: decoding reads every weight once per token). Arguments from add_model_source_args
    are applied here."""

    from ..devices import resolve_dtype
    from ..peft.load import load_model_with_adapter

    requested = getattr(args, "dtype", "auto")
    dtype, why = resolve_dtype(requested, device)
    if requested == "auto" and dtype == "fp32":  # the CPU: today's behaviour, the weights' stored dtype
        weights, why = None, why.replace("fp32", "the stored dtype", 1)
    else:
        weights = DTYPES[dtype]
    if requested == "auto" and not getattr(args, "json", False):
        print(why, file=sys.stderr, flush=True)
    return load_model_with_adapter(args.model, getattr(args, "adapter", None), device=device, dtype=weights,
                                   force_base=getattr(args, "force_base", False))


def prompt_ids_for(tokenizer: Any, prompt: str, chat: bool, system: str | None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the prompt: raw text (BOS per the model), or a chat (with its tool schemas, rendered by the
    template) with the generation prompt."""
    if not prompt.strip():
        raise InputError("--prompt is empty; give some prompt text")
    if system is not None and not chat:
        raise InputError("--system needs --chat (a system message only exists in a chat)")
    if not chat:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": prompt})
    if tools:
        return tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools).ids
    return tokenizer.encode_chat(messages, add_generation_prompt=True).ids


def tool_calls_result(tokenizer: Any, text: str, tools: list[dict[str, Any]], show: bool) -> dict[str, Any]:
    """The calls the model wrote, read back in its template's format (`--tools`); printed as JSON with `show`."""
    import json

    from ..data.tool_calls import call_format, parse_tool_calls, tool_names

    fmt = call_format(tokenizer.chat_template)
    parsed = parse_tool_calls(text, fmt)
    known = tool_names(tools)
    errors = parsed.errors + [f"call of unknown tool {c['name']!r} (not in --tools)" for c in parsed.calls
                              if c["name"] not in known]
    if show:
        for c in parsed.calls:
            print("tool call: " + json.dumps(c, ensure_ascii=False))
        if fmt is None:
            print("note: the chat template's tool-call format is not one entrenar reads back; the text is shown "
                  "as it is", file=sys.stderr)
        for e in errors:
            print(f"warning: {e}", file=sys.stderr)
    return {"tool_calls": parsed.calls, "content": parsed.content, "tool_call_format": fmt,
            "tool_call_errors": errors}


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    from ..devices import resolve_device
    from ..generate import generate
    from ..tokenizer import load_tokenizer, use_chat_template_file

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens is {args.max_new_tokens}; it must be at least 1")
    if not args.prompt.strip():
        raise InputError("--prompt is empty; give some prompt text")
    tools = None
    if args.tools is not None:
        from ..data.tool_calls import load_tools_file

        if not args.chat:
            raise InputError("--tools needs --chat (the chat template renders the tool schemas)")
        tools = load_tools_file(args.tools)
    if args.chat_template is not None and not args.chat:
        raise InputError("--chat-template needs --chat")
    from ..peft.load import tokenizer_spec

    tokenizer = load_tokenizer(tokenizer_spec(args.model, getattr(args, "adapter", None)))
    use_chat_template_file(tokenizer, args.chat_template)
    prompt_ids = prompt_ids_for(tokenizer, args.prompt, args.chat, args.system, tools)
    model = load_generation_model(args, resolve_device(args.device))
    tokenizer.check_ids(prompt_ids, model.cfg.vocab_size)
    max_new = args.max_new_tokens
    if max_new is None:  # the default, not a request: it may shrink to the context that is left
        max_new = min(DEFAULT_MAX_NEW_TOKENS, model.cfg.max_position_embeddings - len(prompt_ids))

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(model, tokenizer, prompt_ids, max_new, args.temperature, args.top_p,
                      args.seed, on_text=None if args.json else show)
    if not args.json:
        sys.stdout.write("\n")
        print(f"[{result.prompt_tokens} prompt tokens, {result.completion_tokens} generated, "
              f"stop: {result.stop_reason}, {result.tokens_per_s:.1f} tok/s]", file=sys.stderr)
    out = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
           "text": result.text, "token_ids": result.token_ids, "stop_reason": result.stop_reason,
           "tokens_per_s": round(result.tokens_per_s, 3), "seed": result.seed}
    if tools is not None:
        out.update(tool_calls_result(tokenizer, result.text, tools, show=not args.json))
    return out


# ---- merge ---------------------------------------------------------------------------------------
def cmd_merge(args: argparse.Namespace) -> dict[str, Any]:
    from ..merge import merge

    result = merge(args.base, args.adapter, args.out, args.onto, force_base=args.force_base)
    if not args.json:
        print(f"merged {result['adapters_merged']} adapters onto the {result['onto']} weights "
              f"({result['trained_against']}) -> {result['out_dir']}")
        print(f"logits vs base+adapter: relL2 {result['logit_rel_l2_vs_trained']:.3g}, "
              f"max |diff| {result['logit_max_abs_diff_vs_trained']:.3g}")
        if "note" in result:
            print(result["note"])
    return result


# ---- registration --------------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "merge", cmd_merge, "fold a LoRA/QLoRA adapter into its base -> HF directory")
    p.add_argument("--base", required=True, help="base MODEL the adapter was trained on")
    p.add_argument("--adapter", required=True, help="PEFT adapter directory (or a LoRA run directory)")
    p.add_argument("--out", required=True, help="HF directory to create (must not exist or be empty)")
    p.add_argument("--force-base", action="store_true",
                   help="merge even if --base is not the base the adapter recorded (exit 2 otherwise)")
    p.add_argument("--onto", choices=ONTO, default="trained",
                   help="trained: onto the weights the adapter was trained against (NF4-dequantized for QLoRA); "
                        "original: onto the 16-bit weights, and report the change (trained)")

    p = add_command(sub, "generate", cmd_generate, "generate text from a prompt (KV-cache decoding)")
    p.add_argument("--model", required=True, help="packaged name, .gguf file, HF directory or run directory")
    p.add_argument("--prompt", required=True, help="prompt text (the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message, with --chat (none)")
    p.add_argument("--tools", metavar="FILE", default=None,
                   help="JSON list of tool schemas ({\"type\": \"function\", \"function\": {name, description, "
                        "parameters}}) rendered by the chat template (with --chat); the calls the model writes are "
                        "printed as JSON, --json: tool_calls (none)")
    p.add_argument("--chat-template", metavar="FILE", default=None, help=CHAT_TEMPLATE_HELP + " (the model's)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens generated at most (default {DEFAULT_MAX_NEW_TOKENS}, or what is left of the model's "
                        f"context if less)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (0.0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling (with --temperature > 0): draw only from the most likely tokens whose "
                        "probabilities add up to P; 1 = all tokens (1.0)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed gives the same text (none: a random one, reported as seed)")
    add_device_option(p)
    p.add_argument("--dtype", default="auto", choices=("auto", *WEIGHT_DTYPES),
                   help="weights and compute dtype: auto = bf16 on a CUDA device with native bf16 (compute "
                        "capability >= 8.0), else the weights' stored dtype (a GGUF dequantizes to fp32) (auto)")
    add_model_source_args(p)

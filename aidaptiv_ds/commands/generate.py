"""Generate text with a model larger than the host memory given to it, its weights streamed from NVMe.

  aidaptiv-ds generate --model out/model --prompt "Once upon a time" --max-new-tokens 64
  aidaptiv-ds generate --model ckpt/ --prompts prompts.jsonl --host-budget 1GiB --nvme-path /nvme/swap
  aidaptiv-ds generate --model out/model --prompt "$(cat report.txt) Summary:" --kv-cache /nvme/kv
  aidaptiv-ds generate --model HuggingFaceTB/SmolLM2-135M-Instruct --chat --prompt "What is the capital of France?"
  aidaptiv-ds generate --model smollm2.gguf --chat                      # a conversation in the terminal
  aidaptiv-ds generate --model out/model --messages talk.json           # the next reply, appended to the file

The model is a Hugging Face folder (safetensors weights, config.json, tokenizer files; what 'aidaptiv-ds export'
writes), a hub id, a .gguf file, or a checkpoint of 'aidaptiv-ds train' (a --save-dir or a tag folder). A prompt
is encoded as the model's tokenizer encodes it; with --chat (or --messages) it goes through the model's chat
template as a user's turn and the reply ends at the model's end of turn. Weights that fit --host-budget
stay in memory; the rest are laid once into the swap space under --nvme-path and streamed layer by layer
through pinned buffers while the model computes (see aidaptiv_ds.inference.streamed). With --kv-cache, the
keys and values of each prompt are kept on the SSD and a later prompt sharing a prefix with it reads them back
instead of computing them (see aidaptiv_ds.inference.kv_store). A mixture-of-experts model that does not fit
reads only the experts its routers choose, per step and layer, or finds them in an expert cache within
--host-budget (--experts, --experts-from; see aidaptiv_ds.inference.expert_cache).

Completions go to stdout (token by token when prompts run one at a time); figures (time to first token,
tokens/s, bytes read) to stderr, and with --metrics-out as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import List, Union

from aidaptiv_ds.commands import flags

HELP_EPILOG = """exit codes:
  0  every prompt completed
  1  bad input (model folder, prompt, sizes), or an I/O error, said in one message
  2  bad command line"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and prompts")
    m.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="the model to run: a Hugging Face folder, a hub id (org/name, from the Hugging Face cache or "
        "downloaded), a .gguf file (converted once into a cached folder), or a checkpoint of 'aidaptiv-ds train'",
    )
    m.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeat the flag for several)"
    )
    m.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='prompts, one per line: {"prompt": TEXT}, {"messages": [...]} (a conversation) or a JSON string '
        "(added after any --prompt)",
    )
    m.add_argument(
        "--chat",
        action="store_true",
        help="each --prompt is a user's turn through the model's chat template; without a prompt, a conversation "
        "on this terminal (one line a turn; /reset starts again, /exit or end of input ends it)",
    )
    m.add_argument(
        "--messages",
        metavar="FILE.json",
        help="a conversation kept in a file (a JSON list of {role, content}): the next reply is generated and "
        "appended to it; with --chat and no prompt, the terminal conversation starts from it and is saved to it",
    )
    m.add_argument("--system", metavar="TEXT", help="with --chat: the system message that opens each conversation")
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0, help="with --sample (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="with --sample: keep the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="with --sample: nucleus mass (default 1.0: all)")
    flags.add(g, flags.SEED, default=None, help="seed of the sampler")
    g.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="prompts decoded together, the weights streamed once per step for all (default 8; 1 with --kv-cache)",
    )
    s = p.add_argument_group("memory and disk")
    flags.add(
        s,
        flags.HOST_BUDGET,
        default="auto",
        help="host memory for weights ('1GiB', bytes, '25%%' of the memory this process may use; default auto: "
        "all of them if they fit half of that memory, its cgroup's limit included, else that half)",
    )
    flags.add(
        s,
        flags.NVME_PATH,
        default=None,
        help="folder on the NVMe SSD for the weights that do not fit the budget (needed only then)",
    )
    s.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when there is one")
    s.add_argument(
        "--gpu-budget",
        default="auto",
        metavar="SIZE",
        help="with cuda: GPU memory for weights, what every step uses, two layers in flight and resident layers "
        "(default auto: three quarters of the GPU memory free; the rest is for activations and the KV cache)",
    )
    flags.add(
        s,
        flags.GPU_MEM_CAP_GB,
        default=None,
        help="with cuda: act as if the GPU had only this much memory (torch.cuda.set_per_process_memory_fraction)",
    )
    s.add_argument(
        "--encode-weights",
        default="auto",
        choices=("auto", "on", "off"),
        help="on CPU, store the streamed layers encoded, losslessly, and decode each as it arrives: bf16 layers are "
        "read in 3/4 of their bytes, fp32 in 7/8 (default auto: bf16 and fp16 layers; on: fp32 too; CUDA reads "
        "them as they are)",
    )
    s.add_argument(
        "--experts",
        default="routed",
        choices=("routed", "whole"),
        help="a mixture-of-experts model that does not fit: read only the experts each step's routers choose, "
        "keeping those used most in memory (default routed, on CPU); whole: every expert with its layer, every step",
    )
    s.add_argument(
        "--experts-from",
        default="auto",
        choices=("auto", "model", "swap"),
        help="where routed experts are read: the model's own safetensors files where they can be read in place, "
        "else copied once into --nvme-path (default auto); model: only in place; swap: always copied",
    )
    flags.add(s, flags.DTYPE, auto=True, default="auto", help="weights' dtype in memory (default auto: as stored)")
    k = p.add_argument_group("prompt cache")
    k.add_argument("--kv-cache", default=None, metavar="DIR", help="keep prompts' keys and values here (on the SSD)")
    k.add_argument("--kv-cache-size", default="8GiB", metavar="SIZE", help="disk cap of --kv-cache (default 8GiB)")
    k.add_argument(
        "--kv-host-budget",
        default="512MiB",
        metavar="SIZE",
        help="entries of --kv-cache also kept in RAM for the next prompt (default 512MiB; 0: none)",
    )
    o = p.add_argument_group("output")
    flags.add(o, flags.METRICS_OUT, default=None, help="write the figures and completions as JSON")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def read_prompts(args: argparse.Namespace) -> List[Union[str, List[dict]]]:
    """The prompts of the command line, texts or conversations (none for a conversation on the terminal)."""

    def opened(text: str):
        if not args.chat:
            return text
        return ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}
        ]

    if args.system and not args.chat:
        raise ValueError("--system is for --chat: give --chat too")
    prompts = [opened(t) for t in args.prompt]
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.prompts} line {n} is not JSON ({e.msg})") from None
                if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                    prompts.append(rec["messages"])
                    continue
                text = rec.get("prompt") if isinstance(rec, dict) else rec
                if not isinstance(text, str):
                    raise ValueError(
                        f'{args.prompts} line {n}: expected {{"prompt": TEXT}}, {{"messages": [...]}} or a JSON string'
                    )
                prompts.append(opened(text))
    if args.messages and prompts:
        raise ValueError("--messages continues one conversation: give it without --prompt / --prompts")
    if args.messages and not args.chat:
        from aidaptiv_ds.inference import conversation

        history = conversation.read(args.messages)
        if not history or history[-1]["role"] != "user":
            raise ValueError(
                f"--messages {args.messages}: the conversation must end with the user's turn to be answered "
                "(add one, or use --chat for a conversation on the terminal)"
            )
        prompts.append(history)
    if not prompts and not args.chat:
        raise ValueError("no prompt: give --prompt TEXT, --prompts FILE.jsonl, --messages FILE or --chat")
    return prompts


def _converse(gen, args, decoding) -> list:
    """A conversation on this terminal: each line read is the user's turn, the reply is streamed as it comes;
    /reset starts again, /exit or the end of input ends it. With --messages it starts from that file's
    conversation and saves it after every reply."""
    from aidaptiv_ds.inference import conversation

    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = conversation.read(args.messages) if args.messages else []
    history = history or list(opening)
    if history and history[-1]["role"] == "user":
        raise ValueError(
            f"--messages {args.messages} ends with an unanswered user turn: answer it without --chat first"
        )
    results = []
    interactive = sys.stdin.isatty()
    if interactive:
        print("aidaptiv-ds generate: chat; /reset starts again, /exit (or Ctrl-D) ends", file=sys.stderr, flush=True)
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            history = list(opening)
            continue
        history.append({"role": "user", "content": text})
        result = gen.generate(
            [list(history)],
            batch_size=1,
            on_text=lambda _i, piece: (sys.stdout.write(piece), sys.stdout.flush()),
            **decoding,
        )[0]
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": result.text})
        results.append(result)
        if args.messages:
            conversation.write(args.messages, history)
    return results


def _progress(quiet: bool):
    last = [0.0]

    def say(message: str) -> None:
        now = time.monotonic()
        if not quiet and now - last[0] >= 2.0:
            last[0] = now
            print(f"aidaptiv-ds generate: {message}", file=sys.stderr, flush=True)

    return say


def run(args: argparse.Namespace) -> int:
    from aidaptiv_ds.common.sizes import format_size
    from aidaptiv_ds.inference.generate import Generator

    def err(message: str) -> int:
        print(f"aidaptiv-ds generate: {flags.as_flags(message)}", file=sys.stderr)
        return 1

    try:
        prompts = read_prompts(args)
    except (OSError, ValueError) as e:
        return err(str(e))
    if args.batch_size < 1:
        return err(f"--batch-size {args.batch_size}: give 1 or more")
    started = time.perf_counter()
    try:
        gen = Generator(
            args.model,
            host_budget=args.host_budget,
            nvme_path=args.nvme_path,
            device=args.device,
            dtype=args.dtype,
            kv_cache=args.kv_cache,
            kv_cache_size=args.kv_cache_size,
            kv_host_budget=args.kv_host_budget,
            progress=_progress(args.quiet),
            gpu_budget=args.gpu_budget,
            gpu_mem_cap_gb=args.gpu_mem_cap_gb,
            encode_weights=args.encode_weights,
            experts=args.experts,
            experts_from=args.experts_from,
        )
    except (OSError, ValueError) as e:
        return err(str(e))
    try:
        st = gen.stats()
        if not args.quiet:
            split = [f"{format_size(st['resident_bytes'])} resident"]
            if st["in_host_bytes_per_pass"]:
                split.append(f"{format_size(st['in_host_bytes_per_pass'])} copied from host memory per step")
            if st["slots"]:
                encoded = st["streamed_bytes_per_pass"] != st["streamed_weight_bytes_per_pass"]
                split.append(
                    f"{format_size(st['streamed_weight_bytes_per_pass'])} streamed per step through {st['slots']} "
                    "slots" + (f" (read encoded: {format_size(st['streamed_bytes_per_pass'])})" if encoded else "")
                )
            if st["by_rows_bytes"]:
                split.append(f"{format_size(st['by_rows_bytes'])} of embedding read by rows")
            ex = st.get("experts")
            if ex and ex["mode"] == "routed":
                split.append(
                    f"{format_size(ex['weight_bytes'])} of experts ({ex['experts']} in {ex['layers']} layers, "
                    f"{ex['top_k']} a token: {format_size(ex['active_bytes_per_token'])}) read as routed from "
                    + ("the model's files" if ex["read_from"] == "model" else "the swap file")
                    + f", a cache of {ex['cache_slots']} experts ({format_size(ex['cache_slots'] * ex['slot_bytes'])})"
                )
            # The studio's compare starts its second model when it sees ", laid out in " (studio/compare.py).
            print(
                f"aidaptiv-ds generate: {format_size(st['weight_bytes'])} of weights, {', '.join(split)} (host budget "
                f"{format_size(st['host_budget'])}"
                + (f", GPU budget {format_size(st['device_budget'])}" if st["device_budget"] is not None else "")
                + f", laid out in {st['layout_s']:.1f} s, {st['device']})",
                file=sys.stderr,
                flush=True,
            )
        if not args.quiet and st.get("experts", {}).get("note"):
            print(f"aidaptiv-ds generate: note: {st['experts']['note']}", file=sys.stderr, flush=True)
        if (
            not args.chat
            and not args.messages
            and getattr(gen.tokenizer, "has_chat_template", False)
            and not args.quiet
        ):
            print(
                "aidaptiv-ds generate: note: this model has a chat template; --chat asks it as a chat "
                "(an instruct model often answers a bare prompt with nothing)",
                file=sys.stderr,
                flush=True,
            )
        decoding = dict(
            max_new_tokens=args.max_new_tokens,
            do_sample=args.sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        conversed = not prompts  # --chat without a prompt: a conversation on this terminal
        if conversed:
            try:
                results = _converse(gen, args, decoding)
            except (OSError, ValueError) as e:
                return err(str(e))
            st = gen.stats()
            prompts = [r.prompt for r in results]
        one_at_a_time = len(prompts) == 1 or args.kv_cache or args.batch_size == 1
        shown = set()

        def on_text(i: int, piece: str) -> None:
            if len(prompts) > 1 and i not in shown:
                shown.add(i)
                sys.stdout.write(f"\n--- prompt {i + 1}/{len(prompts)} ---\n")
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            if not conversed:
                results = gen.generate(
                    prompts, batch_size=1 if one_at_a_time else args.batch_size, on_text=on_text, **decoding
                )
                sys.stdout.write("\n")
                if args.messages:  # the reply joins the conversation in its file
                    from aidaptiv_ds.inference import conversation

                    conversation.write(args.messages, [*prompts[0], {"role": "assistant", "content": results[0].text}])
        except (OSError, ValueError) as e:
            return err(str(e))
        st = gen.stats()
    finally:
        gen.close()
    new = sum(r.new_tokens for r in results)
    for i, r in enumerate(results):
        reuse = f", {r.reused_prefix_tokens} prompt tokens read from the KV cache" if r.reused_prefix_tokens else ""
        read = f", {format_size(r.decode_bytes_per_token)} read per token" if r.new_tokens > 1 else ""
        if r.decode_expert_hit_rate is not None:
            read += f", expert cache hit rate {100 * r.decode_expert_hit_rate:.0f}%"
        print(
            f"aidaptiv-ds generate: prompt {i + 1}: {r.prompt_tokens} prompt tokens, {r.new_tokens} new, first token "
            f"after {r.time_to_first_token_s:.3f} s, {r.tokens_per_s:.2f} tokens/s{read}{reuse}",
            file=sys.stderr,
        )
    if args.metrics_out:
        record = {
            "model": args.model,
            "wall_s": time.perf_counter() - started,
            "new_tokens": new,
            "stats": st,
            "results": [
                dict(
                    dataclasses.asdict(r),
                    tokens_per_s=r.tokens_per_s,
                    decode_bytes_per_token=r.decode_bytes_per_token,
                    decode_expert_hit_rate=r.decode_expert_hit_rate,
                )
                for r in results
            ],
        }
        with open(args.metrics_out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return 0

"""`python -m bench <subcommand>`: argument parsing, model loading and printing.

    python -m bench ppl --text essays/ --context 2048 --json
    python -m bench speed --text essays/ --context 2048,4096 --save results/speed.json
    python -m bench gpu            # "no CUDA device" and exit 0 on a CPU-only machine
    python -m bench gpu --predict --device-profile h100   # the same table predicted from bytes moved
    python -m bench api --context 5000 --rounds 2   # through the app's OpenAI API, restarting it
    python -m bench page --rounds 5                 # a reply sent from the page vs the API, short and long chat
    python -m bench page-updates                    # CPU of one streaming update, server and browser, no model
    python -m bench documents --json                # a chat about an attached file, a follow-up, again, after a restart
    python -m bench search                          # search over 2,000 saved chats: median ms, index size
    python -m bench reading                         # which reading budget answers from a 40k-token document

Progress and loading messages go to stderr; the table goes to stdout, then (with --json) one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infinigen_core import ConfigError, ContextOverflowError, EngineConfig
from infinigen_core.model_flags import add_model_flags, add_setting_flags, engine_settings
from infinigen_core.weights import WEIGHT_CHOICES
from .common import (EvalError, format_table, load_token_ids, machine_description, parse_numbers, parse_policies,
                     read_text, to_json, windows)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _base_config(args, engine=None) -> EngineConfig:
    """The settings given on the command line (checked before the model loads); with the loaded `engine`, its
    model family's defaults (config.FAMILY_DEFAULTS) in every setting left unset."""
    config, chosen = engine_settings(args)
    if getattr(args, "uniform_budget", False):
        config = config.with_changes(budget_by_layer=False)
    if getattr(args, "uniform_heads", False):
        config = config.with_changes(budget_by_head=False)
    if engine is None:
        return config
    from infinigen_core.loading import settings_for_model

    return settings_for_model(engine.model, config, chosen)[0]


def _configs(args, engine=None) -> dict[str, EngineConfig]:
    base = _base_config(args, engine)
    return {name: base.with_changes(policy=name) for name in parse_policies(args.policies)}


def _common(parser: argparse.ArgumentParser, policies: str | None, text: bool = True) -> None:
    if text:
        parser.add_argument("--text", type=Path, required=True, help="a UTF-8 file or a directory of .txt files")
    if policies is not None:
        parser.add_argument("--policies", default=policies, help=f"comma-separated (default {policies})")
    add_setting_flags(parser)
    parser.add_argument("--uniform-budget", action="store_true",
                        help="every sparse layer fetches the same share of its KV (default: InfiniGen spreads the "
                             "budget over the layers by how flat their attention was at calibration)")
    parser.add_argument("--uniform-heads", action="store_true",
                        help="every KV head of a sparse layer fetches the same rows' count (default on the CPU: the "
                             "heads share the layer's budget, a head whose attention spreads reading more)")
    add_model_flags(parser, device_default="cpu", quantize=False)
    _output_flags(parser)


def _output_flags(parser: argparse.ArgumentParser) -> None:
    """--json and --save, which every subcommand takes."""
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--save", type=Path, help="also write the JSON object to this file")


def _add_page_commands(commands) -> None:
    """`page` (a reply sent from the page vs the API) and `page-updates` (what one streaming update costs)."""
    page = commands.add_parser("page", help="a reply's tokens/s sent from the page in Chromium vs the API alone")
    page.add_argument("--max-new-tokens", type=int, default=200)
    page.add_argument("--cases", default="short,long", help="comma-separated: short, long")
    page.add_argument("--rounds", type=int, default=5)
    page.add_argument("--without-browser", action="store_true",
                      help="send the page's turn through its handler and Gradio's queue, no browser (isolates the browser)")
    updates = commands.add_parser("page-updates", help="CPU of one streaming update in the app and the browser")
    updates.add_argument("--updates", type=int, default=80)
    updates.add_argument("--interval", type=float, default=0.1)
    _output_flags(page)
    _output_flags(updates)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="Accuracy and speed of every KV policy on the real decode path")
    commands = parser.add_subparsers(dest="command", required=True)
    _quality_commands(commands)
    _speed_commands(commands)
    _app_commands(commands)
    _library_commands(commands)

    plot = commands.add_parser("plot", help="PNG plots from results saved with --save")
    plot.add_argument("--results", type=Path, required=True, help="directory of saved JSON results")
    plot.add_argument("--out", type=Path, default=Path("docs/plots"))
    _output_flags(plot)
    return parser


def _quality_commands(commands) -> None:
    """What each policy or setting does to the model's output: perplexity, agreement, recall, the sweep."""
    ppl = commands.add_parser("ppl", help="perplexity of long text, scored token by token")
    _common(ppl, "full,infinigen,h2o,streaming")
    ppl.add_argument("--context", required=True, help="tokens per window; comma-separated for several (16384,32768)")
    ppl.add_argument("--prefill", type=int, help="tokens prefilled per window (default: all but the last min(256, N/4))")
    ppl.add_argument("--scored-tokens", type=int, help="score the last N tokens of each window (instead of --prefill)")
    ppl.add_argument("--windows", type=int, default=1, help="windows spread over the text (default 1)")

    agree = commands.add_parser("agree", help="greedy agreement of each policy with the full cache")
    _common(agree, "full,infinigen,h2o,streaming")
    agree.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    agree.add_argument("--new-tokens", type=int, default=64)
    agree.add_argument("--windows", type=int, default=1)

    weights = commands.add_parser("weights", help="perplexity and agreement of compact decode weights against fp32")
    _common(weights, None)
    weights.add_argument("--kinds", default="int8,int4,auto", help="decode weights to compare with fp32 (default int8,int4,auto)")
    weights.add_argument("--policy", default="full", help="the KV policy every kind runs under (default full)")
    weights.add_argument("--context", type=int, default=1024, help="tokens per window (default 1024)")
    weights.add_argument("--prefill", type=int, help="tokens prefilled per window (default: all but the last min(256, N/4))")
    weights.add_argument("--windows", type=int, default=2)
    weights.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared per window (default 32)")

    recall = commands.add_parser("recall", help="per-layer share of the true attention mass fetched")
    _common(recall, "infinigen,h2o,streaming")
    recall.add_argument("--context", type=int, default=2048)
    recall.add_argument("--decode-tokens", type=int, default=32)

    sweep = commands.add_parser("sweep", help="InfiniGen alpha x budget x partial ratio")
    _common(sweep, None)
    sweep.add_argument("--context", type=int, default=2048)
    sweep.add_argument("--prefill", type=int)
    sweep.add_argument("--windows", type=int, default=1)
    sweep.add_argument("--alphas", default="3,4,5,6")
    sweep.add_argument("--budgets", default="0.1,0.2")
    sweep.add_argument("--partial-ratios", default="0.2,0.3")
    sweep.add_argument("--max-ppl-increase", type=float, default=0.01, help="for choosing defaults (0.01 = 1%%)")


def _speed_commands(commands) -> None:
    """How fast: decode per policy, the resume from disk, the GPU shapes."""
    speed = commands.add_parser("speed", help="decode ms/token per policy and its ratio to full, same run")
    _common(speed, "full,offload,infinigen")
    speed.add_argument("--context", default="2048,4096,8192", help="comma-separated contexts")
    speed.add_argument("--decode-tokens", type=int, default=24, help="timed decode steps per policy and context")
    speed.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the policies")
    speed.add_argument("--no-reference", action="store_true", help="skip the plain transformers row")
    speed.add_argument("--weights-rows", metavar="POLICY+KIND,...", default="",
                       help="also these policies with other decode weights, e.g. full+fp32,infinigen+int8, or "
                            "with the decode step uncompiled: full+eager")
    speed.add_argument("--llama-python", type=Path, help="an interpreter with llama-cpp-python: adds llama.cpp's "
                       "rows (same GGUF and token ids, n_threads=2) and each row's ratio to it")
    speed.add_argument("--gguf", type=Path, help="the GGUF llama.cpp loads (default: the model's own, where it is one)")
    speed.add_argument("--llama-flash-attn", default="both", metavar="both|on|off[,...]",
                       help="llama.cpp's flash attention settings: both (the faster is its row), on or off; one for "
                            "every context or one per context, e.g. both,on (a 32k prefill with it off is most of "
                            "an hour at one thread)")
    speed.add_argument("--threads", type=int, default=None,
                       help="torch threads for our rows and n_threads for llama.cpp's (default: torch's count; "
                            "llama.cpp 2). On a loaded machine 1 thread each is the comparison that means something")

    resume = commands.add_parser("resume", help="first token after reopening a saved session vs re-prefill")
    _common(resume, None, text=False)
    resume.add_argument("--context", type=int, default=8192)
    resume.add_argument("--text", type=Path, help="real text: the document and the text scored after the resume "
                                                  "(default: the shipped calibration text, repeated)")
    resume.add_argument("--formats", default="int8,exact",
                        help="KV chunk formats to measure (default int8,exact; int8-partial-keys: the previous int8 "
                             "format, int8 keys with the live partial keys saved; int8-rebuilt: the one before, "
                             "without them, which a resume recomputes from the int8 keys; int8-per-token: the one "
                             "before, without the key channel smoothing either)")
    resume.add_argument("--ppl-tokens", type=int, default=128, help="tokens scored after the resume (default 128)")

    gpu = commands.add_parser("gpu", help="random-weight Llama-2-7B/Llama-3-8B shapes on a CUDA device")
    gpu.add_argument("--models", help="default llama2-7b,llama3-8b (tiny with --emulate)")
    gpu.add_argument("--context", default="4096,8192,16384,32768")
    gpu.add_argument("--policies", default="full,offload,hf-offload,infinigen")
    gpu.add_argument("--budgets", default="0.15,0.1", help="fixed fractions InfiniGen fetches (one row each)")
    gpu.add_argument("--decode-tokens", type=int, default=8)
    gpu.add_argument("--predict", action="store_true",
                     help="no GPU needed: the table predicted from bytes moved per step (bench/gpu_predict.py)")
    gpu.add_argument("--device-profile", default="h100",
                     help="with --predict: h100, h200, or measured rates (a .json from scripts/gpu_probe.py)")
    gpu.add_argument("--h2d-gbps", type=float, help="with --predict: a measured pinned host-to-device peak")
    gpu.add_argument("--emulate", action="store_true",
                     help="the same flow on the CPU under CUDA's rules (INFINIGEN_SEPARATE_DEVICES), tiny shape")
    gpu.add_argument("--compile", choices=["eager", "default", "reduce-overhead"], default="eager",
                     help="the decode step: eager (default), compiled by inductor, or compiled with CUDA graphs "
                          "(reduce-overhead: each layer's attention op stays eager between captured pieces)")
    gpu.add_argument("--trace", type=Path, metavar="DIR",
                     help="also profile 3 consecutive steps (after a warm-up) per model, context and policy "
                          "(InfiniGen at the first budget), timed as the rows' steps are: a Chrome trace, each "
                          "step's time beside the row's median and the top ops by device and host time, in DIR")
    _output_flags(gpu)


def _app_commands(commands) -> None:
    """The running app measured from outside: the API, the page, a chat about a file."""
    api = commands.add_parser("api", help="first token through the OpenAI API, before and after an app restart")
    api.add_argument("--context", type=int, default=5000, help="tokens of the document (default 5000)")
    api.add_argument("--text", type=Path, default=None, help="a folder of .txt files (default: shipped text)")
    api.add_argument("--rounds", type=int, default=1)
    _output_flags(api)

    _add_page_commands(commands)

    documents = commands.add_parser("documents", help="first token for a chat about an attached file: first, "
                                    "in a second new chat, after an app restart")
    documents.add_argument("--tokens", type=int, default=6000, help="tokens of the document (default 6000)")
    documents.add_argument("--text", type=Path, default=None, help="a folder of .txt files (default: bench/data)")
    documents.add_argument("--model", default=None, help="the model app.py serves (--model; default: the default model)")
    documents.add_argument("--max-tokens", type=int, default=8, help="reply tokens per question (default 8)")
    _output_flags(documents)


def _library_commands(commands) -> None:
    """The saved-chat search and the long-document reading benchmarks (issue 32)."""
    search = commands.add_parser("search", help="full-text search over many saved chats: query time, index size")
    search.add_argument("--sessions", type=int, default=2000)
    search.add_argument("--messages", type=int, default=50, help="messages per session (default 50)")
    search.add_argument("--queries", type=int, default=200)
    _output_flags(search)

    reading = commands.add_parser("reading", help="answers from a document longer than the window, per reading "
                                  "budget (passages chosen by BM25)")
    reading.add_argument("--tokens", type=int, default=40_000, help="tokens of the document (default 40000)")
    reading.add_argument("--configs", default=None, help="passage:budget token pairs, comma-separated")
    _output_flags(reading)


def _load_engine(args):
    from infinigen_core import load_engine

    config, chosen = engine_settings(args)
    return load_engine(args.model, device=args.device, config=config, weights=args.weights,
                       compile_decode=args.compile_decode, cpu_kernels=args.cpu_kernels, progress=_log,
                       user_settings=chosen)


def _prefill_for(args) -> int:
    from .ppl import default_prefill

    return args.prefill if args.prefill is not None else default_prefill(args.context)


def run_ppl(args) -> tuple[str, dict]:
    from .ppl import default_prefill, perplexity, with_ratio_to_full

    configs = _configs(args)
    contexts = parse_numbers(args.context, int)
    if args.prefill is not None and len(contexts) > 1:
        raise EvalError("--prefill is for one --context; with several, use --scored-tokens")
    text = read_text(args.text)  # bad input fails before the model loads
    engine = _load_engine(args)
    configs = _configs(args, engine)  # the model family's defaults where no flag was given
    ids = load_token_ids(engine.tokenizer, text, max(contexts), args.text)
    rows, report = [], {"windows": args.windows, "contexts": {}}
    for context in contexts:
        prefill = args.prefill or (context - args.scored_tokens if args.scored_tokens else default_prefill(context))
        results = with_ratio_to_full(perplexity(engine, windows(ids, context, args.windows), prefill, configs, _log))
        rows += [{"context": context, "policy": name, **values} for name, values in results.items()]
        report["contexts"][context] = {"prefill": prefill, **results}
    table = format_table(rows, ["context", "policy", "ppl", "ppl_vs_full", "fetched_ratio", "sparse_fetched_ratio",
                                "ms_per_token", "scored_tokens"])
    if len(contexts) == 1:  # one context: its results at the top, as before several were taken
        (context, results), = report.pop("contexts").items()
        report = {"context": context, **report, **results}
    return table, report


def run_agree(args) -> tuple[str, dict]:
    from .agree import agreement

    configs = _configs(args)
    text = read_text(args.text)  # bad input fails before the model loads
    engine = _load_engine(args)
    configs = _configs(args, engine)  # the model family's defaults where no flag was given
    ids = load_token_ids(engine.tokenizer, text, args.context, args.text)
    results = agreement(engine, windows(ids, args.context, args.windows), args.new_tokens, configs, _log)
    rows = [{"policy": name, **values} for name, values in results.items()]
    return format_table(rows, ["policy", "agreement", "match_prefix", "fetched_ratio", "new_tokens"]), {
        "context": args.context, **results}


def run_weights(args) -> tuple[str, dict]:
    from .weights import compare_weights

    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in WEIGHT_CHOICES]
    if unknown:
        raise EvalError(f"--kinds: unknown {', '.join(unknown)}; use {', '.join(WEIGHT_CHOICES)}")
    config = _base_config(args).with_changes(policy=args.policy)
    text = read_text(args.text)  # bad input fails before the model loads
    engine = _load_engine(args)
    config = _base_config(args, engine).with_changes(policy=args.policy)
    ids = load_token_ids(engine.tokenizer, text, args.context, args.text)
    results = compare_weights(engine, windows(ids, args.context, args.windows), _prefill_for(args), kinds, config,
                              args.new_tokens, _log)
    rows = [{"weights": kind, **values} for kind, values in results.items()]
    table = format_table(rows, ["weights", "ppl", "ppl_vs_fp32", "agreement", "match_prefix", "new_tokens",
                                "max_logit_diff", "ms_per_token", "scored_tokens"])
    return table, {"context": args.context, "prefill": _prefill_for(args), "windows": args.windows,
                   "policy": args.policy, **results}


def run_recall(args) -> tuple[str, dict]:
    from .recall import attention_recall

    configs = _configs(args)
    text = read_text(args.text)  # bad input fails before the model loads
    engine = _load_engine(args)
    configs = _configs(args, engine)  # the model family's defaults where no flag was given
    ids = load_token_ids(engine.tokenizer, text, args.context + args.decode_tokens, args.text)
    results = attention_recall(engine, ids[: args.context], ids[args.context : args.context + args.decode_tokens],
                               configs, _log)
    layers = sorted({layer for r in results.values() for layer in r["per_layer"]})
    rows = [{"layer": layer, **{name: r["per_layer"].get(layer) for name, r in results.items()}} for layer in layers]
    rows.append({"layer": "mean", **{name: r["recall"] for name, r in results.items()}})
    rows.append({"layer": "fetched", **{name: r["fetched_ratio"] for name, r in results.items()}})
    return format_table(rows, ["layer", *results]), {"context": args.context, **results}


def _speed_configs(args, engine=None) -> dict[str, EngineConfig]:
    """The policies' configurations, and one per --weights-rows row (POLICY+KIND)."""
    from .speed import EAGER, NO_KERNELS, row_weights

    configs = _configs(args, engine)
    for name in filter(None, (row.strip() for row in args.weights_rows.split(","))):
        policy, kind = row_weights(name)
        if kind not in (*WEIGHT_CHOICES, EAGER, NO_KERNELS):
            raise EvalError(f"--weights-rows {name!r}: write POLICY+KIND, KIND one of "
                            f"{', '.join((*WEIGHT_CHOICES, EAGER, NO_KERNELS))}")
        configs[name] = _base_config(args, engine).with_changes(policy=policy)
    return configs


def run_speed(args) -> tuple[str, dict]:
    from .speed import decode_speed, flash_attn_per_context, llama_cpp_rows, tokens_needed, with_ratios

    configs = _speed_configs(args)
    contexts = parse_numbers(args.context, int)
    flash_attn_per_context(args.llama_flash_attn.split(","), len(contexts))  # a bad choice fails before the model loads
    text = read_text(args.text)  # bad input fails before the model loads
    gguf = args.gguf
    if args.llama_python and gguf is None:
        from infinigen_core.loading import default_cache_dir, gguf_file_for

        gguf = gguf_file_for(args.model, default_cache_dir(), _log)
        if gguf is None:
            raise EvalError("--llama-python needs --gguf PATH when --model is neither a .gguf nor a packaged model")
    if args.threads is not None:
        if args.threads < 1:
            raise EvalError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    engine = _load_engine(args)
    configs = _speed_configs(args, engine)  # the model family's defaults where no flag was given
    ids = load_token_ids(engine.tokenizer, text, tokens_needed(max(contexts), args.decode_tokens, args.rounds), args.text)
    rows = []
    for context in contexts:
        rows += decode_speed(engine, ids, context, configs, args.decode_tokens, args.rounds,
                             reference=not args.no_reference, progress=_log)
    if args.llama_python:
        _log(f"llama.cpp ({args.llama_python}, {gguf}): contexts {contexts}")
        try:
            peer = llama_cpp_rows(args.llama_python, gguf, ids, contexts, args.decode_tokens, args.rounds,
                                  threads=args.threads or 2, flash_attn=args.llama_flash_attn.split(","))
        except EvalError as error:  # our rows took minutes: keep them, without llama.cpp's column
            _log(f"{error}; the table has no llama.cpp rows")
            peer = []
        rows = with_ratios(rows + peer)
        rows.sort(key=lambda row: row["context"])  # stable: llama.cpp's row after ours, per context
    table = format_table(rows, ["context", "policy", "ms_per_token", "ratio_to_full", "ratio_to_llama_cpp",
                                "prompt_tokens_per_s", "mean_ms", "speculate_ms",
                                "fetch_wait_ms", "attention_ms", "prefill_s", "fetched_ratio", "ops_per_step",
                                "syncs_per_step", "host_copies_per_step", "pool_bytes", "device_bytes",
                                "peak_rss_bytes"])
    return table, {"rows": rows}


def run_sweep(args) -> tuple[str, dict]:
    from .sweep import choose_defaults, sweep

    base = _base_config(args)
    alphas = parse_numbers(args.alphas)
    budgets = parse_numbers(args.budgets)
    partials = parse_numbers(args.partial_ratios)
    for alpha in alphas:  # validate the whole grid before any model work
        for budget in budgets:
            for partial in partials:
                base.with_changes(policy="infinigen", alpha=alpha, budget=budget, partial_ratio=partial)
    text = read_text(args.text)  # bad input fails before the model loads
    engine = _load_engine(args)
    base = _base_config(args, engine)
    ids = load_token_ids(engine.tokenizer, text, args.context, args.text)
    rows = sweep(engine, windows(ids, args.context, args.windows), _prefill_for(args), alphas, budgets, partials,
                 base, _log)
    chosen = choose_defaults(rows, args.max_ppl_increase)
    table = format_table(rows, ["policy", "alpha", "budget", "partial_ratio", "ppl", "ppl_vs_full", "fetched_ratio",
                                "sparse_fetched_ratio", "ms_per_token"])
    if chosen:
        table += (f"\nchosen: alpha {chosen['alpha']}, budget {chosen['budget']}, partial ratio "
                  f"{chosen['partial_ratio']} (least KV fetched within {args.max_ppl_increase:.0%} of full's perplexity)")
    else:
        table += f"\nno combination came within {args.max_ppl_increase:.0%} of full's perplexity"
    return table, {"context": args.context, "rows": rows, "chosen": chosen}


def run_resume(args) -> tuple[str, dict]:
    from .resume import RESUME_COLUMNS, resume_versus_reprefill

    text = read_text(args.text) if args.text else None
    formats = [name.strip() for name in args.formats.split(",") if name.strip()]
    engine = _load_engine(args)
    result = resume_versus_reprefill(engine, args.context, formats=formats, text=text, ppl_tokens=args.ppl_tokens,
                                     progress=_log)
    return format_table(result["rows"], RESUME_COLUMNS), result


def run_gpu(args) -> tuple[str, dict]:
    from .gpu import NO_CUDA_MESSAGE, gpu_benchmark, parse_shapes

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    engine_policies = [p for p in policies if p != "hf-offload"]
    if engine_policies:
        parse_policies(",".join(engine_policies))
    if args.predict:
        from .gpu_predict import predict_table, profile_named

        try:
            profile = profile_named(args.device_profile, args.h2d_gbps)
        except ValueError as error:
            raise EvalError(str(error)) from None
        result = predict_table(parse_shapes(args.models or "llama2-7b,llama3-8b"), parse_numbers(args.context, int), policies,
                               parse_numbers(args.budgets), profile)
    else:
        models = args.models or ("tiny" if args.emulate else "llama2-7b,llama3-8b")
        result = gpu_benchmark(parse_shapes(models), parse_numbers(args.context, int), policies,
                               parse_numbers(args.budgets), args.decode_tokens, _log, save=args.save,
                               emulate=args.emulate, compile_mode=args.compile, trace=args.trace)
    if not result["cuda"] and not result.get("predicted") and not result.get("emulated"):
        return NO_CUDA_MESSAGE, result
    table = format_table(result["rows"], ["model", "context", "policy", "budget", "fetch", "step", "tokens_per_s", "speedup_vs_offload",
                                          "speedup_vs_hf_offload", "ratio_to_full", "ms_per_token",
                                          "bytes_fetched_per_token", "fetch_wait_ms_per_step", "host_copies_per_step",
                                          "worker_calls_per_step", "h2d_gbps", "peak_h2d_gbps", "peak_gpu_bytes"])
    return f"device: {result['device']}\n{table}", result


def run_api(args) -> tuple[None, dict]:
    """Prints each round's row as it ends (a round restarts the app twice: minutes), so no table after."""
    from .api import measure_rounds

    rows = measure_rounds(args.context, args.text, args.rounds, show=lambda line: print(line, flush=True))
    return None, {"context": args.context, "rows": rows}


def run_page(args) -> tuple[None, dict]:
    """Prints each round's row as it ends, so no table after."""
    from .page import measure_rounds

    return None, measure_rounds(args.max_new_tokens, args.rounds, tuple(args.cases.split(",")),
                                show=lambda line: print(line, flush=True), browser=not args.without_browser)


def run_page_updates(args) -> tuple[None, dict]:
    """Prints each row as it is measured, so no table after."""
    from .page_updates import measure

    return None, {"rows": measure(args.updates, args.interval, show=lambda line: print(line, flush=True))}


def run_documents(args) -> tuple[str, dict]:
    from .documents import DATA, measure

    if args.max_tokens < 1:
        raise EvalError("--max-tokens must be at least 1")
    row = measure(args.tokens, args.text or DATA, args.model, args.max_tokens)
    return format_table([row], list(row)), row


def run_search(args) -> tuple[str, dict]:
    from .search import measure

    if min(args.sessions, args.messages, args.queries) < 1:
        raise EvalError("--sessions, --messages and --queries must be at least 1")
    row = measure(args.sessions, args.messages, args.queries, show=_log)
    return format_table([row], list(row)), row


def run_reading(args) -> tuple[str, dict]:
    from .reading import DEFAULT_CONFIGS, measure

    try:
        rows = measure(args.tokens, args.configs or DEFAULT_CONFIGS, show=_log)
    except ValueError as error:
        raise EvalError(f"--configs: {error}") from None
    return format_table(rows, list(rows[0])), {"rows": rows}


def run_plot(args) -> tuple[str, dict]:
    from .plots import make_plots

    if not args.results.is_dir():
        raise EvalError(f"{args.results} is not a directory of saved results")
    made = [str(path) for path in make_plots(args.results, args.out)]
    return "\n".join(made) if made else "no saved results found", {"plots": made}


RUNNERS = {"ppl": run_ppl, "agree": run_agree, "weights": run_weights, "recall": run_recall, "speed": run_speed, "sweep": run_sweep,
           "resume": run_resume, "gpu": run_gpu, "api": run_api, "page": run_page, "page-updates": run_page_updates,
           "documents": run_documents, "search": run_search,
           "reading": run_reading, "plot": run_plot}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        table, result = RUNNERS[args.command](args)
    except (EvalError, ConfigError, ContextOverflowError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = {"command": args.command, "machine": machine_description(), **result}
    if table is not None:
        print(table, flush=True)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(to_json(result) + "\n", encoding="utf-8")
    if args.json:
        print(to_json(result), flush=True)
    return 0

"""The ``python -m client`` command line: generate, stats, tokenize, detokenize, info, load, abort.

Output is for people by default and JSON with ``--json``. A failed call exits non-zero with
``error: CODE_NAME: message`` on stderr (never a traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from .errors import RadixKVError
from .messages import GenerateOptions
from .results import PoolStats, PositionLogprobs, TierStats
from .sync import DEFAULT_CACHE_ADDR, DEFAULT_MODEL_ADDR, RadixKVClient

EXIT_RPC_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
UNARY_TIMEOUT_S = 30.0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.command(args)
    except RadixKVError as error:
        print(f"error: {error.code_name}: {error.message}", file=sys.stderr)
        return EXIT_RPC_ERROR
    except BrokenPipeError:  # the reader went away (`... | head -1`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as error:  # bad input, unreadable certificate file ...
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description="radixkv command line client")
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")

    model_conn = _connection_parser("--addr", DEFAULT_MODEL_ADDR, "model service")
    cache_conn = _connection_parser("--cache-addr", DEFAULT_CACHE_ADDR, "cache service")

    gen = commands.add_parser(
        "generate",
        parents=[model_conn],
        help="generate a completion",
        description="Prints the completion text of PROMPT (only the text, or one JSON object with --json).",
    )
    gen.add_argument("prompt", metavar="PROMPT", help="prompt text ('-' reads it from stdin)")
    gen.add_argument("--max-tokens", type=int, help="most tokens to generate (server default: 128)")
    gen.add_argument("--temperature", type=float, help="0 is greedy (server default: 1.0)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    gen.add_argument("--top-k", type=int, help="keep only the k most likely tokens (0: off)")
    gen.add_argument("--seed", type=int, help="sampler seed: same seed, same output")
    gen.add_argument("--min-p", type=float, help="drop tokens below this share of the top token's probability, in [0, 1]")
    gen.add_argument("--presence-penalty", type=float, help="OpenAI presence penalty in [-2, 2] (0: off)")
    gen.add_argument("--frequency-penalty", type=float, help="OpenAI frequency penalty in [-2, 2] (0: off)")
    gen.add_argument("--repetition-penalty", type=float, help="transformers' repetition penalty, > 0 (1: off)")
    gen.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        type=_logit_bias_arg,
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)",
    )
    gen.add_argument("--min-tokens", type=int, help="no end-of-sequence or stop token before this many tokens")
    gen.add_argument("--logprobs", type=int, metavar="K",
                     help="each generated token's log probability and its K most likely alternatives (0-20)")
    gen.add_argument("--prompt-logprobs", type=int, metavar="K",
                     help="the prompt tokens' log probabilities and K alternatives each (0-20; a full prefill)")
    gen.add_argument("-n", "--n", type=int, metavar="N", dest="n",
                     help="N completions forked from one prefill (1-64; with --seed S choice i uses S + i)")
    gen.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop before this string (repeatable)"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    gen.add_argument("--namespace", default="", help="cache namespace (prefixes are not shared across)")
    gen.add_argument("--request-id", default="", help="request id (default: the server picks one); see abort")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as one user chat message (through the model's chat template)",
    )
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object (with --stream: one JSON object per chunk)"
    )
    gen.set_defaults(command=cmd_generate, default_timeout=None)

    stats = commands.add_parser(
        "stats",
        parents=[cache_conn],
        help="cache service block accounting per pool",
        description="Prints each KV pool's blocks, hit rate and evictions as a table.",
    )
    stats.add_argument("--pool", default="", help="only this pool id")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(command=cmd_stats, default_timeout=UNARY_TIMEOUT_S)

    tok = commands.add_parser(
        "tokenize",
        parents=[model_conn],
        help="token ids of a text",
        description="Prints the token ids of TEXT, space separated.",
    )
    tok.add_argument("text", metavar="TEXT", help="text ('-' reads it from stdin)")
    tok.add_argument("--chat", action="store_true", help="tokenize TEXT as one user chat message")
    tok.add_argument("--json", action="store_true", help="print token ids and token strings as JSON")
    tok.set_defaults(command=cmd_tokenize, default_timeout=UNARY_TIMEOUT_S)

    detok = commands.add_parser(
        "detokenize",
        parents=[model_conn],
        help="the text of token ids",
        description="Prints the text of the token ids ID... (special tokens included).",
    )
    detok.add_argument("ids", metavar="ID", nargs="+", type=_token_id, help="token ids")
    detok.add_argument("--json", action="store_true", help='print {"text": ...} as JSON')
    detok.set_defaults(command=cmd_detokenize, default_timeout=UNARY_TIMEOUT_S)

    info = commands.add_parser("info", parents=[model_conn], help="the served model and KV pool")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(command=cmd_info, default_timeout=UNARY_TIMEOUT_S)

    load = commands.add_parser("load", parents=[model_conn], help="the replica's load now")
    load.add_argument("--json", action="store_true", help="print JSON")
    load.set_defaults(command=cmd_load, default_timeout=UNARY_TIMEOUT_S)

    abort = commands.add_parser(
        "abort",
        parents=[model_conn],
        help="end a running request by id",
        description="Ends the live request REQUEST_ID, whoever opened it: its stream ends with "
        "finish_reason abort.",
    )
    abort.add_argument("request_id", metavar="REQUEST_ID")
    abort.set_defaults(command=cmd_abort, default_timeout=UNARY_TIMEOUT_S)
    return parser


def _connection_parser(flag: str, default: str, what: str) -> argparse.ArgumentParser:
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument(
        flag, dest="addr", default=default, metavar="HOST:PORT", help=f"{what} address (default {default})"
    )
    conn.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds before the call fails with DEADLINE_EXCEEDED "
        f"(default: none for generate, {UNARY_TIMEOUT_S:g} otherwise)",
    )
    conn.add_argument("--tls", action="store_true", help="connect with TLS (system root certificates)")
    conn.add_argument("--root-certs", metavar="PEM", help="root certificates file for TLS (implies --tls)")
    conn.add_argument("--client-cert", metavar="PEM",
                      help="client certificate for mutual TLS (implies --tls; needs --client-key)")
    conn.add_argument("--client-key", metavar="PEM", help="private key of --client-cert")
    conn.add_argument(
        "--token",
        default=os.environ.get("RADIXKV_TOKEN"),
        help="bearer token sent as 'authorization: Bearer ...' (default: $RADIXKV_TOKEN)",
    )
    return conn


def _client(args: argparse.Namespace, *, cache: bool = False) -> RadixKVClient:
    timeout = args.timeout if args.timeout is not None else args.default_timeout
    common = dict(timeout=timeout, tls=args.tls, root_certificates=args.root_certs, token=args.token,
                  client_cert=args.client_cert, client_key=args.client_key)
    if cache:
        return RadixKVClient(cache_addr=args.addr, **common)  # type: ignore[arg-type]
    return RadixKVClient(args.addr, **common)  # type: ignore[arg-type]


def _logit_bias_arg(value: str) -> tuple[int, float]:
    """``ID=BIAS`` of --logit-bias as (token id, bias)."""
    token, sep, bias = value.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 198=-100), got {value!r}") from None


def _text_arg(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


# ---------------------------------------------------------------------------- commands


def generate_options(args: argparse.Namespace, prompt: str) -> tuple[str | None, GenerateOptions]:
    """The prompt argument and options of ``generate()`` for the generate command's flags."""
    options = GenerateOptions(
        stop=args.stop, ignore_eos=args.ignore_eos, namespace=args.namespace, request_id=args.request_id
    )
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "prompt_logprobs", "n"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)  # type: ignore[literal-required]
    if args.logit_bias:
        options["logit_bias"] = dict(args.logit_bias)
    if args.chat:
        options["messages"] = [{"role": "user", "content": prompt}]
    return (None if args.chat else prompt), options


def cmd_generate(args: argparse.Namespace) -> int:
    n = args.n or 1
    if args.stream and n > 1 and not args.json:
        raise ValueError("--stream with -n > 1 needs --json (the choices' chunks interleave)")
    text_prompt, options = generate_options(args, _text_arg(args.prompt))
    with _client(args) as client:
        if not args.stream:
            options.pop("n", None)
            results = client.generate_choices(text_prompt, n=n, **options)
            if args.json:
                body = results[0].to_dict() if n == 1 else {"choices": [r.to_dict() for r in results]}
                print(json.dumps(body, ensure_ascii=False))
                return 0
            for result in results:
                if n > 1:
                    print(f"--- choice {result.index} (finish: {result.finish_reason}) ---")
                print(result.text)
                if result.prompt_logprobs:
                    print("prompt logprobs:\n" + format_logprobs(result.prompt_logprobs))
                if result.logprobs:
                    print("logprobs:\n" + format_logprobs(result.logprobs))
            return 0
        for chunk in client.stream(text_prompt, **options):
            if args.json:
                print(json.dumps(chunk.to_dict(), ensure_ascii=False), flush=True)
            else:
                print(chunk.text, end="", flush=True)
        if not args.json:
            print()
    return 0


def format_logprobs(positions: Sequence[PositionLogprobs]) -> str:
    """One line per position: the token (repr), its log probability and rank, the alternatives."""
    lines = []
    for p in positions:
        top = ", ".join(f"{t.token!r} {t.logprob:.4f}" for t in p.top)
        lines.append(f"  {p.chosen.token!r:<16} {p.chosen.logprob:10.4f}  rank {p.chosen.rank}"
                     + (f"  top: {top}" if top else ""))
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args, cache=True) as client:
        pools = client.stats(args.pool)
    if args.json:
        print(json.dumps({"pools": [dataclasses.asdict(p) for p in pools]}, indent=2))
    elif not pools:
        print("no KV pools registered (is a model service connected to this cache service?)")
    else:
        print(format_stats_table(pools))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    text = _text_arg(args.text)
    with _client(args) as client:
        if args.chat:
            result = client.tokenize(messages=[{"role": "user", "content": text}])
        else:
            result = client.tokenize(text)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), ensure_ascii=False))
    else:
        print(" ".join(str(t) for t in result.token_ids))
    return 0


def _token_id(value: str) -> int:
    try:
        token = int(value)
    except ValueError:
        token = -1
    if not 0 <= token < 2**32:
        raise argparse.ArgumentTypeError(f"not a token id: {value!r}")
    return token


def cmd_detokenize(args: argparse.Namespace) -> int:
    with _client(args) as client:
        text = client.detokenize(args.ids)
    print(json.dumps({"text": text}, ensure_ascii=False) if args.json else text)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = dataclasses.asdict(client.model_info())
    _print_fields(info, args.json)
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    with _client(args) as client:
        load = dataclasses.asdict(client.get_load())
    _print_fields(load, args.json)
    return 0


def cmd_abort(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.abort(args.request_id)
    return 0


def _print_fields(fields: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(fields, indent=2))
        return
    width = max(len(k) for k in fields)
    for key, value in fields.items():
        print(f"{key:<{width}}  {value}")


# ---------------------------------------------------------------------------- formatting

STATS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("POOL", "pool_id"),
    ("BLOCKS", "num_blocks"),
    ("FREE", "num_free_blocks"),
    ("CACHED", "num_cached_blocks"),
    ("LOCKED", "num_locked_blocks"),
    ("PRIVATE", "num_private_blocks"),
    ("RUNNING", "num_running_requests"),
    ("HIT RATE", "hit_rate"),
    ("HIT/QUERIED TOKENS", "hit_tokens"),
    ("EVICTED", "num_evicted_blocks"),
)


TIER_COLUMNS: tuple[tuple[str, str], ...] = (
    ("TIER", ""),
    ("SLOTS", "num_slots"),
    ("CACHED", "num_cached_pages"),
    ("PENDING", "num_pending_pages"),
    ("HIT TOKENS", "hit_tokens"),
    ("LOADED", "num_loaded_pages"),
    ("OFFLOADED", "num_offloaded_pages"),
    ("FAILED", "num_failed_pages"),
    ("EVICTED", "num_evicted_pages"),
    ("POLICY", ""),
)


def format_stats_table(pools: Sequence[PoolStats]) -> str:
    """An aligned text table, one row per pool; then, when some pool has lower tiers (host / disk,
    docs/tiers.md), a table with one POOL/TIER row per tier."""
    table = _align([[title for title, _ in STATS_COLUMNS]] + [_pool_row(pool) for pool in pools])
    tier_rows = [_tier_row(pool, name, tier) for pool in pools
                 for name, tier in (("host", pool.host_tier), ("disk", pool.disk_tier)) if tier is not None]
    if tier_rows:  # no blank line: every line starts with a pool id or a column title
        table += "\n" + _align([[title for title, _ in TIER_COLUMNS]] + tier_rows)
    return table


def _pool_row(pool: PoolStats) -> list[str]:
    row = []
    for _, name in STATS_COLUMNS:
        value = getattr(pool, name)
        if name == "hit_rate":
            row.append(f"{value:.1%}")
        elif name == "hit_tokens":
            row.append(f"{pool.hit_tokens}/{pool.queried_tokens}")
        else:
            row.append(str(value))
    return row


def _tier_row(pool: PoolStats, name: str, tier: TierStats) -> list[str]:
    return ([f"{pool.pool_id}/{name}"] + [str(getattr(tier, field)) for _, field in TIER_COLUMNS[1:-1]]
            + [pool.offload_policy or "-"])


def _align(rows: list[list[str]]) -> str:
    """Rows as aligned text: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)

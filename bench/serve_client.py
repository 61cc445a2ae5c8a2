"""Runs vLLM's own load generator (`vllm.benchmarks.serve`, what `vllm bench serve` runs) once.

python -m bench.serve_client OUT.json -- <vllm bench serve flags>
A process of its own per run, so nothing of one run (event loop, connections, tokenizer threads)
lingers into the next; its result dict is written to OUT.json.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    out_path, flags = argv[0], argv[argv.index("--") + 1:]
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = bench_main(parser.parse_args(flags))
    with open(out_path, "w") as out:
        json.dump(result, out, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])

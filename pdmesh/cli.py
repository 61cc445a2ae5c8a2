"""`pdmesh` command: build-models, digest-weights, up (local demo cluster), generate (client)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

from pdmesh.config import DEFAULT_MODEL_DIR

DEMO_PROMPT = "Hello world, the kalo mine is ready."
DEFAULT_WORKERS = 2   # one per core of the machine kind this is developed on


def _build_models(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.tokenizer_only:  # what a gateway needs, without torch
        from pdmesh.models.tiny import build_tokenizer

        (out / "tiny-llama").mkdir(parents=True, exist_ok=True)
        build_tokenizer(out / "tiny-llama")
        print(f"tiny Llama's tokenizer written to {out / 'tiny-llama'}")
        return 0
    from pdmesh.models.tiny import build_deepseek_v2, build_llama, build_mid_llama

    print(f"tiny Llama written to {build_llama(out / 'tiny-llama')}")
    print(f"tiny DeepSeek-V2 (MoE + MLA) written to {build_deepseek_v2(out / 'tiny-deepseek-v2')}")
    if args.mid:
        print(f"a compute-bound Llama (~104 M parameters) written to {build_mid_llama(out / 'mid-llama')}")
    return 0


def _digest_weights(args: argparse.Namespace) -> int:
    from pdmesh.weights_digest import cache_path, weights_digest

    digest = weights_digest(args.model)
    print(f"{digest}  (cached in {cache_path(Path(args.model))})")
    return 0


async def _print_stream(address: str, prompt: str, max_tokens: int, temperature: float,
                        api_key: str | None = None) -> None:
    from pdmesh.client import make_request, stream_generate

    started = time.perf_counter()
    async for response in stream_generate(address, make_request(prompt, max_tokens, temperature), api_key=api_key):
        print(response.text, end="", flush=True)
        if response.finish_reason:
            seconds = time.perf_counter() - started
            print(f"\n[{response.usage.completion_tokens} tokens in {seconds:.2f}s; {_placement(response)}]")


def _placement(response) -> str:
    """Where the prompt was computed, as the stream's last message tells it."""
    transfer, num_prompt_tokens = response.transfer, response.usage.prompt_tokens
    if transfer.local_prefill:
        return (f"served whole on {transfer.decode_worker}, "
                f"{transfer.num_cached_tokens} of {num_prompt_tokens} prompt tokens from its cache")
    return (f"KV moved: {transfer.num_blocks} blocks, {transfer.num_bytes} bytes; "
            f"decode reused {transfer.num_cached_tokens} of {num_prompt_tokens} prompt tokens")


def _generate(args: argparse.Namespace) -> int:
    asyncio.run(_print_stream(args.gateway, args.prompt, args.max_tokens, args.temperature, args.api_key))
    return 0


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


def _up(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)   # `kill`, systemd, docker stop: the same graceful stop as Ctrl-C
    from pdmesh.cluster import LocalCluster
    from pdmesh.models.tiny import ensure_llama

    model_dir = ensure_llama(Path(args.model))
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdmesh-"))
    num_prefill, num_decode, num_both = _worker_counts(args)
    static = num_both == 0
    shape = f"{num_prefill} prefill + {num_decode} decode" if static else f"{num_both} workers taking both roles"
    print(f"starting gateway + {shape} on {model_dir} (logs: {run_dir})", flush=True)
    redis = ["--registry.redis_url", args.redis_url] if args.redis_url else []
    worker_args = [*redis, "--store.redis_url", args.redis_url] if args.redis_url else []
    gateway_args = ["--first_token_from", args.first_token_from, "--http_port", str(args.http_port), *redis,
                    *(["--kv_index_redis_url", args.redis_url] if args.redis_url else []),
                    *([] if static else ["--disagg_policy", "adaptive"])]
    with LocalCluster(model_dir, run_dir, gateway_port=args.port, num_prefill=num_prefill,
                      num_decode=num_decode, num_both=num_both,
                      telemetry_args=_telemetry_flags(args), worker_args=worker_args,
                      gateway_args=gateway_args, store_dir=run_dir / "kvstore") as cluster:
        workers = (f"prefill {cluster.prefill_addresses}; decode {cluster.decode_addresses}" if static
                   else f"workers {cluster.both_addresses}")
        print(f"gateway {cluster.gateway_address} (OpenAI API http://{cluster.http_address}/v1); {workers}",
              flush=True)
        print("metrics " + ", ".join(f"{name} http://{address}/metrics"
                                     for name, address in cluster.metrics_addresses.items()), flush=True)
        print(f"> {args.prompt}", flush=True)
        asyncio.run(_print_stream(cluster.gateway_address, args.prompt, args.max_tokens, 0.0))
        if args.exit_after_demo:
            return 0
        print(f"serving; try: pdmesh generate 'your prompt' --gateway {cluster.gateway_address}  (Ctrl-C stops)",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping", flush=True)
    return 0


def _worker_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prefill, decode, both-role) workers: both-role ones unless --prefill or --decode asks for a split."""
    if args.prefill is None and args.decode is None:
        return 0, 0, args.workers or DEFAULT_WORKERS
    if args.workers is not None:
        raise SystemExit("pdmesh up: --workers (both roles) or --prefill/--decode (a static split), not both")
    return args.prefill or 1, args.decode or 1, 0


def _telemetry_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--telemetry.metrics_port", "0"]
    if args.otlp_endpoint:
        flags += ["--telemetry.exporter", "otlp", "--telemetry.otlp_endpoint", args.otlp_endpoint]
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser("build-models", help="write the tiny random-weight models and tokenizer")
    build.add_argument("--out", default=str(DEFAULT_MODEL_DIR.parent), help="folder for the model folders")
    build.add_argument("--mid", action="store_true",
                       help="also the compute-bound Llama (~104 M parameters, ~400 MB) of the serving benchmark")
    build.add_argument("--tokenizer-only", action="store_true",
                       help="only the tiny Llama's tokenizer files (a gateway's; needs no torch)")
    build.set_defaults(func=_build_models)

    digest = sub.add_parser("digest-weights", help="hash a model's weights by content once (workers hash them "
                            "at start unless a cached digest is found: run this where a model is staged)")
    digest.add_argument("model", help="model folder")
    digest.set_defaults(func=_digest_weights)

    up = sub.add_parser("up", help="start a gateway and its workers locally and run a demo prompt")
    up.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    up.add_argument("--port", type=int, default=50051)
    up.add_argument("--workers", type=int, default=None,
                    help=f"N workers taking either role per request (python -m node), one core each, placed "
                         f"by the gateway (--disagg_policy adaptive); default {DEFAULT_WORKERS}")
    up.add_argument("--prefill", type=int, default=None,
                    help="a static split instead: this many prefill workers (default 1 with --decode)")
    up.add_argument("--decode", type=int, default=None,
                    help="a static split instead: this many decode workers (default 1 with --prefill)")
    up.add_argument("--prompt", default=DEMO_PROMPT)
    up.add_argument("--max-tokens", type=int, default=32)
    up.add_argument("--run-dir", default=None)
    up.add_argument("--exit-after-demo", action="store_true")
    up.add_argument("--otlp-endpoint", default=None, help="export traces to this OTLP/gRPC collector (host:port)")
    up.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI-compatible HTTP API")
    up.add_argument("--redis-url", default=None,
                    help="Redis (redis://[:password@]host:port/db) for the worker registry and the KV store's "
                         "shared index: prefill workers reuse each other's prefixes, routing follows them")
    up.add_argument("--first-token-from", choices=["decode", "prefill"], default="decode",
                    help="decode: vLLM's P/D flow; prefill: SGLang's (prefill's token streams at once)")
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="send a prompt to a gateway and print the streamed text")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer <key>'")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:   # Ctrl-C during start-up or a second one during shutdown
        return 130


if __name__ == "__main__":
    sys.exit(main())

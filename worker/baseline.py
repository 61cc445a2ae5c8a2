"""Monolithic vLLM baseline: one engine runs prompts end to end. The yardstick for the mesh's
correctness tests (token-for-token) and benchmarks (throughput ratio).

python -m worker.baseline IN.json OUT.json, IN = {"model": DIR, "omp_threads_bind": "0-1", "runs":
[{"prompts": [[ids...] | "text", ...], "sampling": {"max_tokens": N, ...}, "one_at_a_time": false}, ...]}
(or "chats": [[{"role": ..., "content": ...}, ...], ...] instead of "prompts": vLLM's LLM.chat with the
model's chat template); OUT = {"runs":
[{"token_ids": [[...]...], "prompt_token_ids": [[...]...], "seconds": wall time of generate()}, ...]};
a run whose sampling asks for logprobs >= 2 also gets "near_ties": per prompt, per generated token,
[how far the chosen token's logprob is above the best other one's, that other token's id].
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pdmesh.config import EngineSettings
from worker.engine import apply_cpu_env, engine_kwargs


def run_baseline(spec: dict) -> dict:
    engine = EngineSettings(model=spec["model"], omp_threads_bind=spec.get("omp_threads_bind", "auto"),
                            attention_backend=spec.get("attention_backend"))
    apply_cpu_env(engine)
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(engine))
    llm.generate([{"prompt_token_ids": [0, 5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    return {"runs": [_run(llm, SamplingParams, run) for run in spec["runs"]]}


def _run(llm, sampling_cls, run: dict) -> dict:
    """One generate() over all prompts (batched), or one per prompt when run["one_at_a_time"]."""
    if "chats" in run:
        return _outputs(llm.chat(run["chats"], sampling_cls(**run["sampling"]), use_tqdm=False), 0.0)
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in run["prompts"]]
    sampling = sampling_cls(**run["sampling"])
    batches = [[p] for p in prompts] if run.get("one_at_a_time") else [prompts]
    started = time.perf_counter()
    outputs = [o for batch in batches for o in llm.generate(batch, sampling, use_tqdm=False)]
    return _outputs(outputs, time.perf_counter() - started)


def _outputs(outputs, seconds: float) -> dict:
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outputs],
        "seconds": seconds,
    }
    if outputs and outputs[0].outputs[0].logprobs:
        result["near_ties"] = [_margins(o.outputs[0]) for o in outputs]
    return result


def _margins(completion) -> list[list]:
    """Per generated token: [its logprob minus the best other token's, that token's id]."""
    margins = []
    for token_id, ranked in zip(completion.token_ids, completion.logprobs):
        runner_up = max((t for t in ranked if t != token_id), key=lambda t: ranked[t].logprob)
        margins.append([ranked[token_id].logprob - ranked[runner_up].logprob, runner_up])
    return margins


def run_in_subprocess(model_dir: Path, runs: list[dict], work_dir: Path, timeout_s: float = 600,
                      attention_backend: str | None = None) -> dict:
    """run_baseline in a subprocess (one monolithic engine on both cores; its engine processes spawn
    and exit with it): the returned dict's "runs" match `runs`."""
    spec = {"model": str(model_dir), "omp_threads_bind": "0-1", "runs": runs, "attention_backend": attention_backend}
    (work_dir / "in.json").write_text(json.dumps(spec))
    result = subprocess.run([sys.executable, "-m", "worker.baseline", str(work_dir / "in.json"),
                             str(work_dir / "out.json")], capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"monolithic vLLM failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return json.loads((work_dir / "out.json").read_text())


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_baseline(spec)))


if __name__ == "__main__":
    main()

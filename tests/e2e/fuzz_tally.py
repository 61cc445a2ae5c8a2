"""What the fuzz tests and bench/fuzz.py's long profile share: the answers fuzzed calls got, counted
by target (an API, a route, a service method) and outcome ("answered", a gRPC status name or
"HTTP <code>"), with each refusal's message (numbers and quoted values folded) counted too. The
report's run sets PDMESH_FUZZ_EXAMPLES (examples a property) and PDMESH_FUZZ_TALLY (where the session
writes the tally)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import grpc

ANSWERED = "answered"
TALLY_PATH_ENV = "PDMESH_FUZZ_TALLY"
EXAMPLES_ENV = "PDMESH_FUZZ_EXAMPLES"
MESSAGE_CHARS = 100


class FuzzTally:
    """Counts by (target, case, outcome); a case says how the call was built ("valid", "temperature
    fuzzed", "raw bytes"; "" where a target's calls are all built one way)."""

    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, str, str]] = Counter()
        self.messages: Counter[tuple[str, str, str]] = Counter()

    def answered(self, target: str, case: str = "") -> None:
        self.outcomes[target, case, ANSWERED] += 1

    def refused(self, target: str, outcome: str, message: str, case: str = "") -> None:
        self.outcomes[target, case, outcome] += 1
        self.messages[target, outcome, _folded(message)] += 1

    def grpc_error(self, target: str, error: grpc.RpcError, case: str = "") -> None:
        self.refused(target, error.code().name, error.details() or "", case)

    def http_answer(self, target: str, status: int, message: str, case: str = "") -> None:
        if status == 200:
            self.answered(target, case)
        else:
            self.refused(target, f"HTTP {status}", message, case)

    def as_dict(self) -> dict:
        targets: dict[str, dict] = {}
        for (target, case, outcome), count in sorted(self.outcomes.items()):
            counted = targets.setdefault(target, {"outcomes": Counter(), "cases": {}, "messages": []})
            counted["outcomes"][outcome] += count
            if case:
                counted["cases"].setdefault(case, {})[outcome] = count
        for (target, outcome, message), count in self.messages.most_common():
            targets[target]["messages"].append({"outcome": outcome, "message": message, "count": count})
        return targets

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2))


TALLY = FuzzTally()   # the session's: every fuzz test counts into it


def _folded(message: str) -> str:
    """A refusal's message with its numbers, lists of numbers and quoted values folded, so one reason
    counts once ("token ids [N, …] outside the vocabulary [N, N)" whatever the ids)."""
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", message)
    message = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", message)
    return re.sub(r"\[N(, N)*\]", "[N, …]", message)[:MESSAGE_CHARS]

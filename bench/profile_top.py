"""Summarizes a py-spy raw (collapsed) profile: the functions with the most samples, inclusive and self.

python -m bench.profile_top FILE [--top 25] [--thread SUBSTRING]
"""

from __future__ import annotations

import argparse
from collections import Counter


def summarize(lines: list[str], thread: str = "") -> tuple[int, Counter, Counter]:
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or (thread and thread not in stack.split(";", 1)[0]):
            continue
        frames = stack.split(";")
        total += int(count)
        for frame in set(frames[1:]):
            inclusive[frame] += int(count)
        own[frames[-1]] += int(count)
    return total, inclusive, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--thread", default="")
    args = parser.parse_args()
    with open(args.file) as raw:
        total, inclusive, own = summarize(raw.readlines(), args.thread)
    print(f"{total} samples")
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"-- {title}")
        for frame, count in counter.most_common(args.top):
            print(f"{count / max(total, 1):6.1%}  {frame[:150]}")


if __name__ == "__main__":
    main()

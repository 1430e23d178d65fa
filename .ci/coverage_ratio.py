"""The share of the whole suite's covered lines of src/ that the fast tier covers (issue 26: at least 95%).

    python .ci/coverage_ratio.py --fast .coverage.fast --whole .coverage.fast .coverage.slow

Each option takes one or more coverage.py data files; the covered lines of several files are united (the whole
suite is both tiers). Files are matched by their path from ``convgrad/`` on, so data taken in different checkouts
compare. Prints the two line counts, the ratio and the files where the fast tier misses the most lines.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from coverage import CoverageData


def covered(paths: list[str]) -> set[tuple[str, int]]:
    """(path from convgrad/, line) for every line any of the data files saw run."""
    lines: set[tuple[str, int]] = set()
    for path in paths:
        data = CoverageData(basename=path)
        data.read()
        if not data.measured_files():
            raise SystemExit(f"coverage_ratio: {path} holds no measured files")
        for name in data.measured_files():
            key = name[name.rindex("/convgrad/") + 1:] if "/convgrad/" in name else name
            lines.update((key, n) for n in data.lines(name) or ())
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", nargs="+", required=True, help="the fast tier's data file(s)")
    parser.add_argument("--whole", nargs="+", required=True, help="the data files of both tiers")
    parser.add_argument("--min", type=float, default=95.0, help="the least share, in percent (default 95)")
    args = parser.parse_args(argv)
    fast, whole = covered(args.fast), covered(args.whole) | covered(args.fast)
    share = 100 * len(fast & whole) / len(whole)
    print(f"lines covered by the whole suite: {len(whole)}; by the fast tier: {len(fast & whole)} ({share:.1f}%)")
    missed = Counter(path for path, _ in whole - fast)
    for path, n in missed.most_common(10):
        print(f"  fast tier misses {n:4d} lines of {path}")
    return 0 if share >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tables from a profiled run of the suite (`pytest --suite-profile=DIR`, see `make test-profile`).

    python -m tests.profile_report DIR [--slowest 30]

Prints per test file: the tests run, their wall seconds (setup + call + teardown, summed over
the test processes), the part of it spent building XLA programs (tracing, lowering, backend
compilation or a load from the persistent cache) and the programs built; then the slowest
tests with the same split; then the totals. Time in a test's own subprocesses is "other".
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _load(directory: Path) -> list[dict]:
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def _compile_s(r: dict) -> float:
    return r.get("trace_s", 0.0) + r.get("lower_s", 0.0) + r.get("backend_s", 0.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--slowest", type=int, default=30)
    args = parser.parse_args(argv)
    records = _load(args.directory)
    if not records:
        raise SystemExit(f"no records under {args.directory} (run pytest --suite-profile=DIR)")

    files: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for r in records:
        f = files[r["test"].split("::")[0]]
        f["tests"] += 1
        f["wall_s"] += r["wall_s"]
        f["compile_s"] += _compile_s(r)
        f["compiles"] += r.get("compiles", 0)

    print(f"{'file':<34} {'tests':>6} {'wall s':>8} {'compile s':>10} {'%':>4} {'programs':>9}")
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"]):
        share = 100 * f["compile_s"] / f["wall_s"] if f["wall_s"] else 0.0
        print(
            f"{name.removeprefix('tests/'):<34} {f['tests']:>6.0f} {f['wall_s']:>8.1f} "
            f"{f['compile_s']:>10.1f} {share:>4.0f} {f['compiles']:>9.0f}"
        )

    print(f"\nthe {args.slowest} slowest tests")
    print(f"{'wall s':>7} {'compile s':>9} {'other s':>8} {'programs':>8}  test")
    for r in sorted(records, key=lambda r: -r["wall_s"])[: args.slowest]:
        c = _compile_s(r)
        print(
            f"{r['wall_s']:>7.1f} {c:>9.1f} {r['wall_s'] - c:>8.1f} {r.get('compiles', 0):>8.0f}  "
            f"{r['test'].removeprefix('tests/')}"
        )

    programs: dict[str, list[float]] = defaultdict(list)
    for r in records:
        for name, seconds in r.get("programs", []):
            programs[name].append(seconds)
    print(f"\nthe {args.slowest} programs that took longest to build, over all tests")
    print(f"{'seconds':>8} {'builds':>6}  program (builds of 0.5 s or more)")
    for name, times in sorted(programs.items(), key=lambda kv: -sum(kv[1]))[: args.slowest]:
        print(f"{sum(times):>8.1f} {len(times):>6}  {name}")

    wall = sum(r["wall_s"] for r in records)
    compile_s = sum(_compile_s(r) for r in records)
    requests = sum(r.get("cache_requests", 0) for r in records)
    hits = sum(r.get("cache_hits", 0) for r in records)
    stages = {s: sum(r.get(s, 0.0) for r in records) for s in ("trace_s", "lower_s", "backend_s")}
    print(
        f"\n{len(records)} tests, {wall:.0f} s summed over the processes; building programs "
        f"{compile_s:.0f} s ({100 * compile_s / wall:.0f}%: trace {stages['trace_s']:.0f}, "
        f"lower {stages['lower_s']:.0f}, compile or load {stages['backend_s']:.0f}); "
        f"{sum(r.get('compiles', 0) for r in records):.0f} programs; persistent cache "
        + (f"hits {hits} of {requests} ({100 * hits / requests:.0f}%)" if hits else "hits none")
    )


if __name__ == "__main__":
    main()

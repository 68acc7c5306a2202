"""The bfloat16 precision policy: which products an accelerator multiplies in bfloat16, and
how accurate the results are.

Structure: every kind's `chunk_X` on bfloat16 inputs, forward and forward + backward,
lowered for a GPU (`jax.export`, no GPU needed; XLA:CPU itself multiplies the
bfloat16-rounded operands in float32), its `dot_general`s counted by operand dtype:

    python benchmarks/precision.py                 # the structure table
    python benchmarks/precision.py --accuracy      # and the accuracy table (slow)
    python benchmarks/precision.py --accuracy --t 4096 --cp 8
    python benchmarks/precision.py --accuracy --kinds delta_rule   # some kinds only

Accuracy: flash-linear-attention's `get_err_ratio` (relative RMS error) of outputs, final
state and gradients against the float64 token loops (tests/test_precision.py), on one
device and under context parallelism.
"""

import argparse
import collections
import os
import sys


def _devices(argv: list[str]) -> int:
    for i, a in enumerate(argv):
        if a == "--cp" and i + 1 < len(argv):
            return max(8, int(argv[i + 1]))
    return 8


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={_devices(sys.argv)}"
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _families(kinds: list[str] | None) -> list:
    from tests.registry import FAMILIES

    names = [f.name for f in FAMILIES]
    unknown = sorted(set(kinds or ()) - set(names))
    if unknown:
        raise SystemExit(f"unknown kinds {unknown}; the kinds are {names}")
    return [f for f in FAMILIES if kinds is None or f.name in kinds]


def structure(kinds: list[str] | None) -> None:
    from tests.test_precision import census, float32_place

    print("bfloat16 policy, dot_generals in the module lowered for a GPU (each once):")
    for family in _families(kinds):
        for grad in (False, True):
            found = census(family, grad=grad)
            bf16 = [p for p in found if p.operands == ("bf16", "bf16") and p.result == "f32"]
            rest = [p for p in found if p not in bf16]
            where = collections.Counter(float32_place(p) or p.where() for p in rest)
            names = ", ".join(f"{n} x{c}" for n, c in sorted(where.items())) or "none"
            pass_ = "fwd+bwd" if grad else "fwd    "
            print(
                f"  {family.name:22s} {pass_} {len(bf16):3d} of {len(found):3d} dots bfloat16 -> "
                f"float32; the float32 ones are: {names}"
            )


def accuracy(t: int, cp: int, kinds: list[str] | None) -> None:
    from tests.test_precision import _errors, WIDE

    print(f"bfloat16 inputs and policy, T={t}, {WIDE}: relative RMS error vs float64 loop")
    print(f"  {'kind':22s} {'out':>9s} {'state':>9s} {'grad':>9s} | cp={cp}: out, state, grad")
    for family in _families(kinds):
        one = _errors(family, t, **WIDE)
        many = _errors(family, t, cp=cp, **WIDE)
        print(
            f"  {family.name:22s} {one['out']:9.2e} {one['state']:9.2e} {one['grad']:9.2e} | "
            f"{many['out']:9.2e} {many['state']:9.2e} {many['grad']:9.2e}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--accuracy", action="store_true", help="also the accuracy table")
    parser.add_argument("--no-structure", action="store_true", help="skip the structure table")
    parser.add_argument("--t", type=int, default=4096, help="sequence length (accuracy)")
    parser.add_argument("--cp", type=int, default=8, help="ranks for the cp column (accuracy)")
    parser.add_argument("--kinds", nargs="+", help="only these kinds (test ids, e.g. delta_rule)")
    args = parser.parse_args()
    if not args.no_structure:
        structure(args.kinds)
    if args.accuracy:
        accuracy(args.t, args.cp, args.kinds)


if __name__ == "__main__":
    main()

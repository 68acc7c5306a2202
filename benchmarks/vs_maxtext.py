"""Our chunked gated delta rule vs MaxText's JAX kernel and transformers', on the same CPU.

Three peers on the same float32 inputs (chunk 64, q/k L2 norm on, B=1, K=V=128):

- ours: `deltanet_cp.chunk_gated_delta_rule` (jitted);
- MaxText 0.2.5: `jax_chunk_gated_delta_rule` from `maxtext/models/qwen3.py`, with
  `compute_dtype=float32` and q/k repeated from H to HV heads (value head j reads key
  head j // (HV/H)); loaded from the installed file without importing the package (see
  `benchmarks/_maxtext.py`);
- transformers: `torch_chunk_gated_delta_rule` (PyTorch, eager, the raw function).

At two shapes (Qwen3-Next heads H=16, HV=32, T=2048; and H=HV=4, T=4096) it prints forward
and forward+backward times (medians over paired rounds: each round runs every call once,
the order rotating; the ratios are medians of the per-round ratios), the largest
relative difference between the peers' outputs, and XLA's compiled temporaries per token
(`memory_analysis().temp_size_in_bytes / T`) for the two JAX peers. Then context
parallelism at cp=4 on 4 simulated CPU devices: ours (`chunk_gated_delta_rule_cp` in
`jax.shard_map`, allgather exchange) vs MaxText's CP path (`cp_axis=`, the Hillis-Steele
prefix over `ppermute` of `kernels/attention/gdn_cp.py`, in `shard_map` with
`check_vma=False`): temporaries per device per token (T/4 tokens per rank) and times
(the 4 simulated devices share this machine's cores, so CP times measure the total work,
not a speedup).

The backward is `jax.grad` (or `.backward()`) of `sum(o * w_o) + sum(h_T * w_h)` with
respect to q, k, v, g and beta; each peer returns its final state (MaxText only returns
it when given an `initial_state`, so it gets zeros).

Every measurement runs in a worker subprocess. MaxText calls
`jax.scipy.linalg.solve_triangular`, which can deadlock in jaxlib's CPU LAPACK solve; a
worker whose CPU time stops advancing for `--hang-after` seconds is killed, the call it
was in is reported as "hang", and the worker reruns without that peer.

Needs the benchmark environment of `make bench` (torch, transformers, and the maxtext
wheel installed without its dependencies); never a library dependency.

    python benchmarks/vs_maxtext.py [--quick] [--repeats N] [--budget SECONDS]
"""

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time


HERE = os.path.dirname(os.path.abspath(__file__))
# (label, B, T, H, HV, K = V, paired rounds on one device, paired rounds at cp=4).
# Transformers' forward+backward at the Qwen3-Next heads takes seconds a call on 2 cores.
SHAPES = [
    ("Qwen3-Next heads: H=16, HV=32", 1, 2048, 16, 32, 128, 3, 2),
    ("H=HV=4", 1, 4096, 4, 4, 128, 5, 2),
]
QUICK = [  # --quick: same heads, a quarter (an eighth) of the tokens, two rounds
    ("Qwen3-Next heads: H=16, HV=32", 1, 256, 16, 32, 128, 2, 2),
    ("H=HV=4", 1, 1024, 4, 4, 128, 2, 2),
]
CHUNK = 64
CP = 4
PEERS = ["ours", "maxtext", "transformers"]
NAMES = {"ours": "ours", "maxtext": "MaxText", "transformers": "transformers"}
MARK = "@@ "  # worker lines meant for the driver


# --------------------------------------------------------------------------- worker


def emit(**record):
    print(MARK + json.dumps(record), flush=True)


def worker(args):
    """One shape, one device (`--cp 1`) or `--cp` simulated devices; streams JSON lines."""
    if args.cp > 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cp}"
        ).strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _common import gdn_inputs

    # MaxText first: if its solve deadlocks, it does so before the others were compiled.
    order = ["maxtext", "ours", "transformers"]
    peers = [p for p in order if p not in args.skip and not (args.cp > 1 and p == "transformers")]
    _, b, t, h, hv, d, *_ = (QUICK if args.quick else SHAPES)[args.shape]
    rng = np.random.default_rng(0)
    inputs = gdn_inputs(rng, b, t, h, hv, d)
    w_o = rng.standard_normal((b, t, hv, d), dtype=np.float32)  # loss weights
    w_h = rng.standard_normal((b, hv, d, d), dtype=np.float32)

    if args.cp > 1:
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((args.cp,), ("cp",), devices=jax.devices()[: args.cp])
        seq, rep = NamedSharding(mesh, P(None, "cp")), NamedSharding(mesh, P())
        jargs = [jax.device_put(x, seq) for x in inputs]
        jw = (jax.device_put(w_o, seq), jax.device_put(w_h, rep))
    else:
        jargs = [jnp.asarray(x) for x in inputs]
        jw = (jnp.asarray(w_o), jnp.asarray(w_h))

    def jax_peer(name, forward):
        def loss(q, k, v, g, beta, w_o, w_h):
            o, h_t = forward(q, k, v, g, beta)
            return jnp.sum(o * w_o) + jnp.sum(h_t * w_h)

        compiled = {}
        for pass_name, fn, a in [
            ("fwd", forward, jargs),
            ("fwd+bwd", jax.grad(loss, argnums=tuple(range(5))), jargs + list(jw)),
        ]:
            emit(step=f"{name} compile {pass_name}")
            start = time.perf_counter()
            c = jax.jit(fn).lower(*a).compile()
            memory = c.memory_analysis()
            emit(
                peer=name,
                pass_=pass_name,
                compile_s=time.perf_counter() - start,
                temp_bytes=None if memory is None else memory.temp_size_in_bytes,
            )
            compiled[pass_name] = (c, a)
        return (
            lambda: jax.block_until_ready(compiled["fwd"][0](*compiled["fwd"][1])),
            lambda: jax.block_until_ready(compiled["fwd+bwd"][0](*compiled["fwd+bwd"][1])),
            lambda: [np.asarray(x) for x in compiled["fwd"][0](*compiled["fwd"][1])],
        )

    calls, outputs = {}, {}
    for name in peers:
        if name == "ours":
            import deltanet_cp as dcp

            kw = dict(use_qk_l2norm=True, output_final_state=True, chunk_size=CHUNK)
            if args.cp > 1:

                def per_rank(q, k, v, g, beta):
                    return dcp.chunk_gated_delta_rule_cp(
                        q, k, v, g, beta, axis_name="cp", exchange="allgather", **kw
                    )

                forward = jax.shard_map(
                    per_rank, mesh=mesh, in_specs=(P(None, "cp"),) * 5, out_specs=(seq.spec, P())
                )
            else:

                def forward(q, k, v, g, beta):
                    return dcp.chunk_gated_delta_rule(q, k, v, g, beta, **kw)

        elif name == "maxtext":
            from _maxtext import load_maxtext

            mt = load_maxtext()
            emit(maxtext_version=mt.version)
            rep_heads = hv // h

            def maxtext(q, k, v, g, beta, cp_axis=None):
                q, k = jnp.repeat(q, rep_heads, axis=2), jnp.repeat(k, rep_heads, axis=2)
                zeros = jnp.zeros((q.shape[0], hv, d, d), jnp.float32)  # to get h_T back
                return mt.jax_chunk_gated_delta_rule(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    chunk_size=CHUNK,
                    initial_state=zeros,
                    use_qk_norm_in_gdn=True,
                    cp_axis=cp_axis,
                    compute_dtype=jnp.float32,
                )

            if args.cp > 1:
                forward = jax.shard_map(
                    lambda *a: maxtext(*a, cp_axis="cp"),
                    mesh=mesh,
                    in_specs=(P(None, "cp"),) * 5,
                    out_specs=(seq.spec, P()),
                    check_vma=False,
                )
            else:
                forward = maxtext
        else:
            import torch
            from transformers.models.qwen3_next import modeling_qwen3_next

            torch.set_num_threads(len(os.sched_getaffinity(0)))
            emit(torch_version=torch.__version__)
            ref = modeling_qwen3_next.torch_chunk_gated_delta_rule
            ref = getattr(ref, "__wrapped__", ref)  # the raw function, not the hub wrapper
            targs = [torch.from_numpy(x) for x in inputs]
            tw = (torch.from_numpy(w_o), torch.from_numpy(w_h))

            def tforward(*a):
                return ref(
                    *a, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True, output_final_state=True
                )

            def t_fwd():
                with torch.no_grad():
                    return tforward(*targs)

            def t_fwd_bwd():
                leaves = [x.clone().requires_grad_(True) for x in targs]
                o, h_t = tforward(*leaves)
                ((o * tw[0]).sum() + (h_t * tw[1]).sum()).backward()
                return [x.grad for x in leaves]

            calls[f"{name} fwd"], calls[f"{name} fwd+bwd"] = t_fwd, t_fwd_bwd
            emit(step=f"{name} first call")
            outputs[name] = [x.numpy() for x in t_fwd()]
            continue
        fwd, fwd_bwd, out = jax_peer(name, forward)
        calls[f"{name} fwd"], calls[f"{name} fwd+bwd"] = fwd, fwd_bwd
        emit(step=f"{name} first call")
        outputs[name] = out()

    done = [p for p in PEERS if p in outputs]
    for i, a in enumerate(done):
        for b_ in done[i + 1 :]:
            diffs = [
                float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
                for x, y in zip(outputs[a], outputs[b_])
            ]
            emit(diff=[a, b_], o=diffs[0], h=diffs[1])
    for name, call in calls.items():  # warm-up: every call once more (fwd+bwd's first)
        emit(step=f"{name} warm-up")
        call()
    names = list(calls)
    for r in range(args.rounds):
        row = {}
        for name in names[r % len(names) :] + names[: r % len(names)]:
            emit(step=f"{name} round {r}")
            start = time.perf_counter()
            call = calls[name]
            call()
            row[name] = time.perf_counter() - start
        emit(round=row, load=os.getloadavg()[0])
    emit(step="done")


# --------------------------------------------------------------------------- driver


def run_worker(argv: list[str], deadline: float, hang_after: float) -> tuple[list, str]:
    """Run a worker until it ends, hangs (no CPU time for `hang_after` s) or hits `deadline`.

    Returns its records and how it ended: "ok", "hang", "budget" or "failed: ...".
    """
    from _common import cpu_seconds

    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", *argv],
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so a kill takes its threads too
    )
    lines: queue.Queue = queue.Queue()
    stderr: list[str] = []
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    records, ended = [], None
    last_cpu, last_progress = -1.0, time.monotonic()
    while ended is None:
        time.sleep(0.5)
        while not lines.empty():
            line = lines.get()
            if line.startswith(MARK):
                records.append(json.loads(line[len(MARK) :]))
        if proc.poll() is not None:
            time.sleep(0.2)  # let the reader threads drain
            while not lines.empty():
                line = lines.get()
                if line.startswith(MARK):
                    records.append(json.loads(line[len(MARK) :]))
            tail = "".join(stderr[-5:]).strip()
            ended = "ok" if proc.returncode == 0 else f"failed ({proc.returncode}): {tail}"
            break
        cpu = cpu_seconds(proc.pid)
        now = time.monotonic()
        if cpu is not None and cpu > last_cpu + 0.05:
            last_cpu, last_progress = cpu, now
        if now - last_progress > hang_after:
            ended = "hang"
        elif now > deadline:
            ended = "budget"
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()
    return records, ended


def measure(argv, deadline, hang_after, log, retries=0):
    """Run a worker; if one peer hangs, note it and run again without that peer.

    What a hung attempt reported before the hang (compiled temporaries, output
    differences) is kept; its timing rounds are not (they stopped part-way).
    """
    skip, hangs, kept = [], {}, []
    while True:
        skips = [a for s in skip for a in ("--skip", s)]
        records, ended = run_worker(argv + skips, deadline, hang_after)
        steps = [r["step"] for r in records if "step" in r]
        where = steps[-1] if steps else "start-up"
        if ended == "ok":
            return kept + records, hangs, ended
        log(f"  worker {' '.join(argv + skips)} ended: {ended} (in: {where})")
        peer = where.split()[0]
        if ended != "hang" or peer not in PEERS:
            return kept + records, hangs, ended
        hangs.setdefault(peer, []).append(where)
        if len(hangs[peer]) > retries:
            skip.append(peer)
        kept += [r for r in records if "round" not in r]


def summarize(records):
    temps, rounds, diffs, info = {}, [], {}, {}
    for r in records:
        if "temp_bytes" in r:
            temps[(r["peer"], r["pass_"])] = r["temp_bytes"]
        elif "round" in r:
            rounds.append(r["round"])
        elif "diff" in r:
            diffs[tuple(r["diff"])] = (r["o"], r["h"])
        elif "maxtext_version" in r or "torch_version" in r:
            info.update(r)
    return temps, rounds, diffs, info


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="paired rounds per case")
    parser.add_argument("--budget", type=float, default=780, help="seconds for the whole run")
    parser.add_argument("--hang-after", type=float, default=30, help="seconds without CPU time")
    parser.add_argument("--retries", type=int, default=0, help="reruns of a peer that hung")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--skip", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, HERE)
    import jax
    from _common import machine_line, paired_ratio, print_table

    start = time.monotonic()
    deadline = start + args.budget
    print(
        f"jax {jax.__version__}, float32, chunk {CHUNK}, qk l2norm on; every case in a worker "
        f"subprocess (a peer whose worker stops using CPU for {args.hang_after:.0f} s is "
        "reported as a hang)"
    )
    print(f"machine before: {machine_line()}", flush=True)
    shapes = QUICK if args.quick else SHAPES
    results = {}
    for cp in [1, CP]:
        for i, (label, _, t, *_, r1, rcp) in enumerate(shapes):
            rounds = args.repeats or (r1 if cp == 1 else rcp)
            if time.monotonic() > deadline:
                results[(cp, i)] = ([], {}, "skipped: time budget spent")
                continue
            argv = ["--shape", str(i), "--cp", str(cp), "--rounds", str(rounds)]
            argv += ["--quick"] if args.quick else []
            begun = time.monotonic()
            results[(cp, i)] = measure(argv, deadline, args.hang_after, print, args.retries)
            print(
                f"{label}, T={t}, cp={cp}: {results[(cp, i)][2]} in "
                f"{time.monotonic() - begun:.0f} s; {machine_line()}",
                flush=True,
            )

    info = {}
    for records, *_ in results.values():
        info.update(summarize(records)[3])
    print(
        f"\npeers: MaxText {info.get('maxtext_version', '?')} (jax_chunk_gated_delta_rule, "
        f"compute_dtype=float32), transformers' torch_chunk_gated_delta_rule "
        f"(torch {info.get('torch_version', '?')})"
    )

    def cell(rounds, name, hangs, ended):
        vals = [r[name] for r in rounds if name in r]
        if vals:
            return f"{statistics.median(vals) * 1e3:.0f}"
        if name.split()[0] in hangs:
            return "hang"
        return "-" if ended == "ok" else ended.split(":")[0]

    def ratio(rounds, num, den):
        pairs = [r for r in rounds if num in r and den in r]
        if not pairs:
            return "-"
        return f"{paired_ratio([r[num] for r in pairs], [r[den] for r in pairs]):.2f}x"

    def kib(temps, peer, pass_name, tokens):
        b = temps.get((peer, pass_name))
        return None if b is None else b / tokens / 1024

    def kib_cell(v, peer, hangs, one_device=None):
        if v is None:
            return "hang" if peer in hangs else "-"
        if one_device is None:
            return f"{v:.0f}"
        return f"{v:.0f} ({v / one_device:.2f}x)"

    def diff_cell(diffs, a, b, which, hangs):
        if (a, b) in diffs:
            return f"{diffs[(a, b)][which]:.1e}"
        return "hang" if {a, b} & set(hangs) else "-"

    time_rows, diff_rows, mem_rows, cp_rows, notes = [], [], [], [], []
    for i, (label, _, t, *_rest) in enumerate(shapes):
        name = f"{label}, T={t}"
        records, hangs, ended = results[(1, i)]
        temps, rounds, diffs, _ = summarize(records)
        for pass_name in ["fwd", "fwd+bwd"]:
            o, m, tf = (f"{p} {pass_name}" for p in PEERS)
            time_rows.append(
                [
                    name,
                    pass_name,
                    cell(rounds, o, hangs, ended),
                    cell(rounds, m, hangs, ended),
                    cell(rounds, tf, hangs, ended),
                    ratio(rounds, m, o),
                    ratio(rounds, tf, o),
                    ratio(rounds, tf, m),
                    len(rounds),
                ]
            )
        pairs = [("ours", "maxtext"), ("ours", "transformers"), ("maxtext", "transformers")]
        diff_rows.append(
            [name, "1"]
            + [diff_cell(diffs, a, b, 0, hangs) for a, b in pairs]
            + [diff_cell(diffs, "ours", "maxtext", 1, hangs)]
        )
        keys = [(p, s) for p in PEERS[:2] for s in ("fwd", "fwd+bwd")]
        one = {k: kib(temps, *k, t) for k in keys}
        mem_rows.append([f"{name}, one device"] + [kib_cell(one[k], k[0], hangs) for k in keys])
        records, hangs, ended = results[(CP, i)]
        temps, rounds, diffs, _ = summarize(records)
        per_rank = {k: kib(temps, *k, t / CP) for k in keys}
        mem_rows.append(
            [f"{name}, cp={CP}, per device, {t // CP} tokens/rank"]
            + [kib_cell(per_rank[k], k[0], hangs, one[k]) for k in keys]
        )
        for pass_name in ["fwd", "fwd+bwd"]:
            o, m = (f"{p} {pass_name}" for p in PEERS[:2])
            cp_rows.append(
                [
                    name,
                    pass_name,
                    cell(rounds, o, hangs, ended),
                    cell(rounds, m, hangs, ended),
                    ratio(rounds, m, o),
                    len(rounds),
                ]
            )
        diff_rows.append(
            [name, str(CP), diff_cell(diffs, "ours", "maxtext", 0, hangs), "", ""]
            + [diff_cell(diffs, "ours", "maxtext", 1, hangs)]
        )
        for cp in [1, CP]:
            for peer, wheres in results[(cp, i)][1].items():
                ran = any(f"{peer} fwd" in r for r in summarize(results[(cp, i)][0])[1])
                notes.append(
                    f"{NAMES[peer]} hung at {name}, cp={cp}, in: {'; '.join(wheres)} "
                    f"({'timed on a rerun' if ran else 'no times'})"
                )
            if results[(cp, i)][2] != "ok":
                notes.append(f"{name}, cp={cp}: {results[(cp, i)][2]}")

    print_table(
        [
            "shape (B=1, K=V=128)",
            "pass",
            "ours ms",
            "MaxText ms",
            "transformers ms",
            "ours / MaxText speed",
            "ours / transformers speed",
            "MaxText / transformers speed",
            "rounds",
        ],
        time_rows,
        title="One device, float32: medians over paired rounds (speed ratios = median of "
        "per-round time ratios; > 1 means the first is faster)",
    )
    print_table(
        ["", "ours fwd", "ours fwd+bwd", "MaxText fwd", "MaxText fwd+bwd"],
        mem_rows,
        title="Compiled temporaries, KiB per token (XLA memory_analysis().temp_size_in_bytes; "
        f"at cp={CP} per device per token of the rank, and the ratio to one device)",
    )
    print_table(
        [
            "shape",
            "pass",
            "ours ms",
            "MaxText ms",
            "ours / MaxText speed",
            "rounds",
        ],
        cp_rows,
        title=f"cp={CP} on {CP} simulated CPU devices sharing this machine's cores (ours: "
        "allgather exchange; MaxText: its ppermute prefix): total work, not a speedup",
    )
    print_table(
        [
            "shape",
            "cp",
            "o: ours vs MaxText",
            "o: ours vs transformers",
            "o: MaxText vs transformers",
            "h_T: ours vs MaxText",
        ],
        diff_rows,
        title="Largest relative difference of outputs (max |a - b| / max |b|)",
    )
    if notes:
        print("\n" + "\n".join(notes))
    print(f"\nmachine after: {machine_line()}; whole run {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()

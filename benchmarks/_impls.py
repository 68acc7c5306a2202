"""The implementations we compare, as forward functions and as `_harness` factories.

Every implementation computes the chunked gated delta rule with q/k L2 normalisation, the
final state returned, on the same inputs (`_common.gdn_inputs`, seed 0; `q, k: (B, T, H,
K)`, `v: (B, T, HV, V)`, `g, beta: (B, T, HV)`):

- `ours`: `deltanet_cp.chunk_gated_delta_rule` (one device, and with
  `cp=ContextParallel("cp", mesh=mesh)` the sequence over a mesh axis);
- `maxtext`: MaxText's `jax_chunk_gated_delta_rule`, read from its files (`_maxtext.py`),
  `compute_dtype` = the case's dtype; under CP its `cp_axis=` path in `shard_map`;
- `jla`: jax-linear-attention's plain-JAX `jla.ops.chunked.gated_delta_rule` (`_jla.py`);
  under CP its `context_parallel_linear_attention`;
- `transformers`: Hugging Face's `torch_chunk_gated_delta_rule` (eager PyTorch, the raw
  function, not the hub-kernel wrapper);
- `fla`: flash-linear-attention's Triton `chunk_gated_delta_rule` (CUDA only);
- `family`: our other recurrences (Gated DeltaNet-2, the generalized delta rule, Kimi
  Delta Attention, gated linear attention / Mamba-2, ...) and jax-linear-attention's
  plain-JAX `gdn2`, on their own inputs;
- `square_rates`: the machine's float32 matmul rate on large square products, through
  XLA and through numpy's BLAS (the yardstick beside the implementations' rates).

MaxText and jla take q and k with as many heads as v: they get them repeated (value head
`j` reads key head `j // (HV / H)`, as Qwen3-Next does); the others broadcast themselves.
MaxText returns its final state only when given an initial one, so it gets zeros.

The forward+backward pass ("fwd+bwd") is the forward and the pullback of fixed random
cotangents of `o` and the final state to all five inputs (`jax.vjp`,
`torch.autograd.backward`): the gradients of `sum(o * do) + sum(h_T * dh)`.
"""

import importlib.metadata
import os
import sys
import tempfile
import time

import numpy as np
from _common import gdn_inputs
from _harness import Prepared
from _seqdepth import matmul_flops


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSES = ("fwd", "fwd+bwd")


def problem(b: int, t: int, h: int, hv: int, d: int) -> tuple[list, tuple]:
    """float32 numpy inputs `[q, k, v, g, beta]` and cotangents `(do, dh)`, the same for all."""
    inputs = gdn_inputs(np.random.default_rng(0), b, t, h, hv, d)
    rng = np.random.default_rng(1)
    d_o = rng.standard_normal((b, t, hv, d), dtype=np.float32)
    d_h = rng.standard_normal((b, hv, d, d), dtype=np.float32)
    return inputs, (d_o, d_h)


def import_ours():
    """`deltanet_cp`, installed or from this checkout (given metadata if never installed)."""
    try:
        import deltanet_cp

        return deltanet_cp
    except importlib.metadata.PackageNotFoundError:
        pass
    # The package reads its version from its metadata; a checkout that was never installed
    # has none, so give it some (a dist-info directory on sys.path).
    site = tempfile.mkdtemp(prefix="bench-meta-")
    info = os.path.join(site, "deltanet_cp-0.0.0+checkout.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: deltanet_cp\nVersion: 0.0.0+checkout\n")
    sys.path.append(site)
    for name in [m for m in sys.modules if m.startswith("deltanet_cp")]:
        del sys.modules[name]
    import deltanet_cp

    return deltanet_cp


def load_peer(name: str, wheels: str | None = None):
    """The module or namespace behind a JAX implementation, and a version string."""
    if name == "ours":
        dcp = import_ours()
        return dcp, dcp.__version__
    if name == "maxtext":
        from _maxtext import find_wheel, load_maxtext

        try:
            mt = load_maxtext()
        except ImportError:
            wheel = find_wheel(wheels) if wheels else None
            if wheel is None:
                raise
            mt = load_maxtext(wheel=wheel)
        return mt, mt.version
    if name == "jla":
        from _jla import load_jla

        jla = load_jla(wheels)
        return jla, jla.version
    raise ValueError(f"no JAX implementation called {name!r}")


def jax_forward(name: str, *, h: int, hv: int, d: int, chunk: int = 64, dtype="float32", **kw):
    """`forward(q, k, v, g, beta) -> (o, h_T)` of JAX implementation `name` on one device."""
    import jax.numpy as jnp

    peer, _ = load_peer(name, kw.get("wheels"))
    rep = hv // h
    if name == "ours":
        # `precision`: the products' policy (None: from the inputs, bfloat16 -> "bfloat16").
        rule = peer.GatedDeltaRule(
            chunk_size=chunk, use_qk_l2norm=True, precision=kw.get("precision")
        )
        block_size = kw.get("block_size")  # None: the backend's default
        memory = kw.get("memory")  # None: "low", what the backward keeps

        def forward(q, k, v, g, beta):
            inputs = peer.DeltaInputs(q, k, v, g, beta)
            if memory is None:  # (runs on the releases before `memory=`)
                return peer.run(rule, inputs, block_size=block_size)
            return peer.run(rule, inputs, block_size=block_size, memory=memory)

    elif name == "maxtext":

        def forward(q, k, v, g, beta):
            q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
            return peer.jax_chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                chunk_size=chunk,
                initial_state=jnp.zeros((q.shape[0], hv, d, d), jnp.float32),
                use_qk_norm_in_gdn=True,
                compute_dtype=jnp.dtype(dtype),
            )

    else:

        def forward(q, k, v, g, beta):
            q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
            return peer.chunked.gated_delta_rule(
                q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk
            )

    return forward


def jax_forward_cp(
    name: str, mesh, *, h: int, hv: int, d: int, chunk: int = 64, exchange=None, **kw
):
    """`forward` of JAX implementation `name` with the sequence sharded over `mesh`'s axis
    `"cp"` (global arrays in, sharded `P(None, "cp")`; global arrays out)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    peer, _ = load_peer(name, kw.get("wheels"))
    rep = hv // h
    if name == "ours":
        options = {} if exchange is None else {"exchange": exchange}
        cp = peer.ContextParallel("cp", mesh=mesh, **options)

        def forward(q, k, v, g, beta):
            return peer.chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm=True, chunk_size=chunk, cp=cp
            )

        return forward
    if name == "maxtext":

        def per_rank(q, k, v, g, beta):
            q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
            return peer.jax_chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                chunk_size=chunk,
                initial_state=jnp.zeros((q.shape[0], hv, d, d), jnp.float32),
                use_qk_norm_in_gdn=True,
                cp_axis="cp",
                compute_dtype=jnp.float32,
            )

        return jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(P(None, "cp"),) * 5,
            out_specs=(P(None, "cp"), P()),
            check_vma=False,
        )

    def forward(q, k, v, g, beta):
        q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
        return peer.context_parallel.context_parallel_linear_attention(
            "gated_deltanet",
            q,
            k,
            v,
            mesh=mesh,
            axis="cp",
            g=g,
            beta=beta,
            output_final_state=True,
            use_qk_l2norm=True,
            chunk_size=chunk,
        )

    return forward


def pullback(forward):
    """`fwd_bwd(args, cotangents)`: the forward and the pullback of `cotangents` to `args`."""
    import jax

    def fwd_bwd(args, cotangents):
        return jax.vjp(forward, *args)[1](cotangents)

    return fwd_bwd


def _sample(o, sample):
    o = np.asarray(o, np.float32)
    return o if sample is None else o[:, -sample:]


# ------------------------------------------------------------------ harness factories


def _jax(name, *, b, t, h, hv, d, chunk=64, dtype="float32", passes=PASSES, sample=None, **kw):
    import jax.numpy as jnp

    _, version = load_peer(name, kw.get("wheels"))
    forward = jax_forward(name, h=h, hv=hv, d=d, chunk=chunk, dtype=dtype, **kw)
    inputs, cot = problem(b, t, h, hv, d)
    dt = jnp.dtype(dtype)
    q, k, v, g, beta = (jnp.asarray(x) for x in inputs)
    args = (q.astype(dt), k.astype(dt), v.astype(dt), g, beta.astype(dt))  # g stays float32
    return _compiled(forward, version, args, cot, d=d, passes=passes, sample=sample)


def _compiled(forward, version, args, cot, *, d, passes, sample=None) -> Prepared:
    """A `Prepared` of a JAX `forward(*args) -> (o, h_T)`: each pass compiled, with its
    temporaries and matmul FLOPs, and the machine's matmul rate in `args[0]`'s dtype."""
    import jax
    import jax.numpy as jnp

    out = jax.eval_shape(forward, *args)
    cots = tuple(jnp.asarray(c, o.dtype) for c, o in zip(cot, out))
    device = jax.devices()[0]
    info = {
        "version": version,
        "jax": jax.__version__,
        "device": f"{jax.default_backend()} ({getattr(device, 'device_kind', device)})",
    }
    programs = {"fwd": (forward, args), "fwd+bwd": (pullback(forward), (args, cots))}
    calls = {}
    for p in passes:
        fn, a = programs[p]
        start = time.perf_counter()
        c = jax.jit(fn).lower(*a).compile()
        info[f"compile_s {p}"] = time.perf_counter() - start
        m = c.memory_analysis()
        if m is not None:
            info[f"temp_bytes {p}"] = m.temp_size_in_bytes
            info[f"peak_bytes {p}"] = (
                m.argument_size_in_bytes
                + m.output_size_in_bytes
                + m.temp_size_in_bytes
                - m.alias_size_in_bytes
            )
        info[f"matmul_flops {p}"] = matmul_flops(c)
        calls[p] = lambda c=c, a=a: jax.block_until_ready(c(*a))
    info["matmul_rate"] = matmul_rate(d, args[0].dtype)

    def outputs():
        o, h_t = jax.jit(forward)(*args)
        return {"o": _sample(o, sample), "h": np.asarray(h_t, np.float32)}

    return Prepared(calls, outputs, info)


def matmul_rate(d: int, dtype, *, batch: int = 512, rows: int = 64, calls: int = 5) -> float:
    """This process's matmul FLOP/s on the products a chunked kernel is made of: `batch`
    float32 products `(rows, d) x (d, d)` at `Precision.HIGHEST` in one `einsum`, the best
    of `calls` timed calls (the machine's limit for this work, measured beside the kernel)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((batch, rows, d)), dtype)
    b = jnp.asarray(rng.standard_normal((batch, d, d)), dtype)
    f = jax.jit(lambda a, b: jnp.einsum("nij,njk->nik", a, b, precision=jax.lax.Precision.HIGHEST))
    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(f(a, b))
        best = min(best, time.perf_counter() - start)
    return 2.0 * batch * rows * d * d / best


def square_rates(backend: str, sizes, *, calls: int = 3) -> dict:
    """This process's float32 FLOP/s on large square products `(n, n) x (n, n)`: through
    XLA (`backend="xla"`, `jax.jit` of `a @ b` at `Precision.HIGHEST`) or numpy's BLAS
    (`"numpy"`), per `n` in `sizes` the best of `calls` timed calls after an untimed one.
    The CPU's matmul rate where a product is large enough to reach it.

    **Returns:**

    `{"what": <the library and its version>, "rates": {str(n): FLOP/s}}`.
    """
    rng = np.random.default_rng(3)
    if backend == "xla":
        import jax
        import jax.numpy as jnp

        f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
        what = f"XLA (jaxlib {jax.__version__}, jax.jit of a @ b)"

        def product(a, b):
            return jax.block_until_ready(f(a, b))

        def array(x):
            return jnp.asarray(x)

    elif backend == "numpy":
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]  # pyright: ignore
        what = f"numpy {np.__version__} ({blas.get('name', '?')} {blas.get('version', '')})"

        def product(a, b):
            return a @ b

        def array(x):
            return x

    else:
        raise ValueError(f"no backend called {backend!r}: 'xla' or 'numpy'")
    rates = {}
    for n in sizes:
        a, b = (array(rng.standard_normal((n, n), dtype=np.float32)) for _ in range(2))
        product(a, b)
        best = float("inf")
        for _ in range(calls):
            start = time.perf_counter()
            product(a, b)
            best = min(best, time.perf_counter() - start)
        rates[str(n)] = 2.0 * n**3 / best
    return {"what": what, "rates": rates}


def ours(**case) -> Prepared:
    """Ours on one device (`deltanet_cp.chunk_gated_delta_rule`)."""
    return _jax("ours", **case)


def maxtext(**case) -> Prepared:
    """MaxText's `jax_chunk_gated_delta_rule` on one device."""
    return _jax("maxtext", **case)


def jla(**case) -> Prepared:
    """jax-linear-attention's `jla.ops.chunked.gated_delta_rule` on one device."""
    return _jax("jla", **case)


def _family_inputs(kind: str, b: int, t: int, h: int, hv: int, d: int) -> list:
    """float32 numpy inputs in the public argument order of recurrence `kind`, seed 0."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def sigmoid(x):
        return (1 / (1 + np.exp(-x))).astype(np.float32)

    def log_decay(*shape):
        return (-np.log1p(np.exp(normal(*shape)))).astype(np.float32)

    q, k, v = normal(b, t, h, d), normal(b, t, h, d), normal(b, t, hv, d)
    if kind == "gla":  # a decay per key channel
        return [q, k, v, log_decay(b, t, hv, d)]
    if kind == "mamba2":  # a decay per head
        return [q, k, v, log_decay(b, t, hv)]
    if kind == "gdn":
        return [q, k, v, log_decay(b, t, hv), sigmoid(normal(b, t, hv))]
    if kind == "kda":
        return [q, k, v, log_decay(b, t, hv, d), sigmoid(normal(b, t, hv))]
    if kind == "precond_gdn":  # (q, k, v, g_atk, g, beta_atk, beta)
        g_atk, g = log_decay(b, t, h), log_decay(b, t, hv)
        return [q, k, v, g_atk, g, sigmoid(normal(b, t, h)), sigmoid(normal(b, t, hv))]
    if kind == "precond_kda":  # (q, k, v, g, g_atk, beta_atk, beta)
        g, g_atk = log_decay(b, t, hv, d), log_decay(b, t, h)
        return [q, k, v, g, g_atk, sigmoid(normal(b, t, h)), sigmoid(normal(b, t, hv))]
    if kind in ("gdn2", "jla_gdn2"):
        g = log_decay(b, t, hv, d)
        return [q, k, v, g, sigmoid(normal(b, t, hv, d)), sigmoid(normal(b, t, hv, d))]
    if kind == "momentum":  # q, k, v, log_alpha, log_mu, p, beta, eta
        decays = [log_decay(b, t, hv), log_decay(b, t, hv)]
        steps = [sigmoid(normal(b, t, hv)), sigmoid(normal(b, t, hv))]
        return [q, k, v, *decays, normal(b, t, h, d), *steps]
    kk = normal(b, t, h, d)
    kk = kk / np.linalg.norm(kk, axis=-1, keepdims=True)
    a, bb = -kk, kk * sigmoid(normal(b, t, h, d))
    return [q, k / np.sqrt(d), v, a, bb, log_decay(b, t, hv, d)]


def family(*, kind: str, b, t, h, hv, d, chunk=64, passes=PASSES, **kw) -> Prepared:
    """One of our recurrences on one device, float32: ours (`kind` gdn, kda, gdn2, dplr,
    gla, mamba2, precond_gdn, precond_kda or momentum: `chunk_gated_delta_rule`,
    `chunk_kda`, `chunk_gdn2`, `chunk_dplr_delta_rule` with RWKV-7-like inputs,
    `chunk_gla` with a decay per key channel or per head,
    `chunk_precond_gated_delta_rule`, `chunk_precond_kda`,
    `chunk_momentum_delta_rule` with FLA's defaults) or jax-linear-attention's
    `jla.ops.chunked.gdn2` (`jla_gdn2`, q and k repeated to `hv` heads)."""
    import jax.numpy as jnp

    if kind == "momentum":
        return _momentum(b=b, t=t, h=h, hv=hv, d=d, chunk=chunk, passes=passes)
    if kind == "jla_gdn2":
        from _jla import load_jla

        jla = load_jla(kw.get("wheels"))
        version = jla.version

        def forward(q, k, v, g, b, w):
            q, k = jnp.repeat(q, hv // h, axis=2), jnp.repeat(k, hv // h, axis=2)
            return jla.chunked.gdn2(
                q, k, v, g, b, w, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk
            )

    else:
        dcp = import_ours()
        version = dcp.__version__
        if kind == "dplr":

            def forward(*args):
                return dcp.chunk_dplr_delta_rule(*args, chunk_size=chunk)

        elif kind in ("precond_gdn", "precond_kda"):
            precond = {
                "precond_gdn": dcp.chunk_precond_gated_delta_rule,
                "precond_kda": dcp.chunk_precond_kda,
            }[kind]

            def forward(*args):  # (o, final state); the preconditioner's final state unused
                return precond(*args, use_qk_l2norm=True, chunk_size=chunk)[:2]

        else:
            fn = {
                "gdn": dcp.chunk_gated_delta_rule,
                "kda": dcp.chunk_kda,
                "gdn2": dcp.chunk_gdn2,
                "gla": dcp.chunk_gla,
                "mamba2": dcp.chunk_gla,
            }[kind]

            def forward(*args):
                return fn(*args, use_qk_l2norm=True, chunk_size=chunk)

    args = tuple(jnp.asarray(x) for x in _family_inputs(kind, b, t, h, hv, d))
    cot = problem(b, t, h, hv, d)[1]
    return _compiled(forward, version, args, cot, d=d, passes=passes)


def _momentum(*, b, t, h, hv, d, chunk, passes) -> Prepared:
    """`deltanet_cp.chunk_momentum_delta_rule` with FLA's defaults, its final state (S, M)
    as one `(B, HV, 2K, V)` array (and its cotangent twice GDN's)."""
    import jax.numpy as jnp

    dcp = import_ours()

    def forward(*args):
        o, final = dcp.chunk_momentum_delta_rule(*args, chunk_size=chunk, use_qk_l2norm=True)
        return o, jnp.concatenate([final[0], final[1]], axis=-2)

    args = tuple(jnp.asarray(x) for x in _family_inputs("momentum", b, t, h, hv, d))
    d_o, d_h = problem(b, t, h, hv, d)[1]
    cot = (d_o, np.concatenate([d_h, d_h[..., ::-1, :]], axis=-2))
    return _compiled(forward, dcp.__version__, args, cot, d=d, passes=passes)


def _torch(fn, device, version, *, b, t, h, hv, d, dtype="float32", passes=PASSES, sample=None):
    import torch

    inputs, cot = problem(b, t, h, hv, d)
    dt = getattr(torch, dtype)
    q, k, v, g, beta = (torch.from_numpy(x).to(device) for x in inputs)
    args = (q.to(dt), k.to(dt), v.to(dt), g, beta.to(dt))
    d_o, d_h = (torch.from_numpy(c).to(device) for c in cot)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    info = {"version": version, "torch": torch.__version__, "device": device}
    if device == "cpu":
        info["threads"] = torch.get_num_threads()

    def fwd():
        with torch.no_grad():
            out = fn(*args)
        sync()
        return out

    def fwd_bwd():
        leaves = [x.detach().requires_grad_(True) for x in args]
        o, h_t = fn(*leaves)
        torch.autograd.backward([o, h_t], [d_o.to(o.dtype), d_h.to(h_t.dtype)])
        sync()
        return [x.grad for x in leaves]

    def with_peak(name, call):
        """On CUDA, the first two calls (the harness's first call and warm-up) record the
        peak of `max_memory_allocated` into `info`; the timed calls run as they are."""
        seen = []

        def wrapped():
            if device != "cuda" or len(seen) >= 2:
                return call()
            torch.cuda.reset_peak_memory_stats()
            out = call()
            info[f"peak_bytes {name}"] = torch.cuda.max_memory_allocated()
            seen.append(1)
            return out

        return wrapped

    def outputs():
        o, h_t = fwd()
        return {"o": _sample(o.float().cpu().numpy(), sample), "h": h_t.float().cpu().numpy()}

    calls = {"fwd": fwd, "fwd+bwd": fwd_bwd}
    return Prepared({p: with_peak(p, calls[p]) for p in passes}, outputs, info)


def transformers(*, chunk: int = 64, **case) -> Prepared:
    """Hugging Face transformers' `torch_chunk_gated_delta_rule`, eager, on the CPU."""
    import torch
    import transformers as hf
    from transformers.models.qwen3_next import modeling_qwen3_next

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    ref = modeling_qwen3_next.torch_chunk_gated_delta_rule
    ref = getattr(ref, "__wrapped__", ref)  # the raw function, not the hub-kernel wrapper

    def fn(*args):
        return ref(*args, chunk_size=chunk, use_qk_l2norm_in_kernel=True, output_final_state=True)

    return _torch(fn, "cpu", hf.__version__, **case)


def fla(*, chunk: int = 64, **case) -> Prepared:
    """flash-linear-attention's Triton `chunk_gated_delta_rule` (chunk 64 is built in)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device: FLA's Triton kernels need one")
    import fla as fla_package
    import triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fn(q, k, v, g, beta):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    version = f"{getattr(fla_package, '__version__', '?')} (triton {triton.__version__})"
    return _torch(fn, "cuda", version, **case)

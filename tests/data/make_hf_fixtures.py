"""Generate Hugging Face `transformers` reference fixtures for deltanet_cp's parity tests.

This script is the ONLY place that touches torch/transformers. The test suite never imports
torch: it reads the files written here (safetensors + json) with numpy/safetensors and compares
deltanet_cp's JAX results against them.

How to run (from the repository root, in the separate fixture virtualenv):

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0 transformers numpy safetensors
    .venv-bench/bin/python tests/data/make_hf_fixtures.py

Deterministic (fixed seeds, one torch thread, float32 on CPU, byte-identical output files on
re-runs) and takes a few seconds.

What it writes (all under tests/data/):

Layer fixtures, one per weight layout (`<name>` is `qwen3_next_gdn` or `qwen3_5_gdn`):
  <name>.json            tiny config with transformers' field names (hidden_size,
                         linear_num_key_heads, ...) plus hidden_act, model_type, class name,
                         weight key prefix, versions and the cross-check results.
  <name>.safetensors     the layer's state dict exactly as transformers names it, under the
                         prefix `model.layers.0.linear_attn.` (a loader must accept a prefix).
                         Weights only.
  <name>_io.safetensors  inputs, outputs and intermediates of the HF forward, batch 1, for
                         T=37 (one padded chunk) and T=130 (three chunks of 64, last padded):
                           x_<T>        (1, T, hidden)   layer input
                           out_<T>      (1, T, hidden)   layer output (the target)
                           g_<T>        (1, T, HV)       log-decay passed to the kernel
                           beta_<T>     (1, T, HV)       sigmoid(b) passed to the kernel
                           core_<T>     (1, T, HV, V)    kernel output (before gated RMSNorm)
                         and for T=37 only (file size):
                           q_37, k_37   (1, 37, H, K)    after conv+SiLU; kernel inputs (before
                                                         head repeat and l2norm)
                           v_37         (1, 37, HV, V)   after conv+SiLU; kernel input
                           z_37         (1, 37, HV, V)   gate of the gated RMSNorm

The layer runs transformers' pure-torch chunked path (`torch_chunk_gated_delta_rule` and the
torch `causal_conv1d_fn`): the script refuses to run if `fla`, `causal_conv1d` or `kernels` is
importable, swaps the modeling module's kernel globals for the raw torch functions, and checks
that the chunked function was called. It also checks each HF output against an independent
float64 numpy re-implementation of the layer (`_np_layer`, the math of DESIGN.md section 5) and
against transformers' token-by-token recurrent kernel.

Kernel fixtures:
  torch_chunk_gdn.safetensors / .json
      torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=64,
      initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True);
      layout (B, T, heads, dim). Two cases, keys carry the case suffix:
        ""      B=1, T=50, H=HV=2, K=16, V=8 (one padded chunk)
        "_gva"  B=1, T=100, H=2, HV=4, K=16, V=8 (grouped value heads, two chunks)
      keys: q, k (B,T,H,K); v (B,T,HV,V); g, beta (B,T,HV); initial_state (B,HV,K,V);
      out (B,T,HV,V); final_state (B,HV,K,V).
  torch_kda.safetensors / .json
      Kimi Linear's chunk_kimi_delta_attention, g per key channel. B=1, T=100, H=2, K=16, V=8.
      keys: q, k (B,T,H,K); v (B,T,H,V); g (B,T,H,K); beta (B,T,H); initial_state (B,H,K,V);
      out (B,T,H,V); final_state (B,H,K,V).

Random parameters: every parameter is randomized (A_log, dt_bias, norm.weight and conv1d.weight
included) so the fixture is sensitive to every term. The per-head decay rates A = exp(A_log) are
spread log-uniformly over [0.02, 16], not just [1, 16]: with A >= 1 every head forgets within a
few tokens, and a wrong cross-chunk state hand-off would go unnoticed. The json records how much
the T=130 output after the first chunk changes when that chunk is dropped.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file


OUT_DIR = Path(__file__).resolve().parent
PREFIX = "model.layers.0.linear_attn."
SEED = 20240601
EXPECTED_TORCH = "2.13.0"
CHUNK = 64
CONV_W = 4

TINY: dict = dict(
    hidden_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,  # K != V on purpose
    linear_conv_kernel_dim=CONV_W,
    rms_norm_eps=1e-6,
    hidden_act="silu",  # the conv activation is `config.hidden_act` in transformers
)
SEQ_LENS = (37, 130)  # 37: one padded chunk; 130: 3 chunks of 64, the last one padded


# ------------------------------------------------------------------------------------------------
# environment guards
# ------------------------------------------------------------------------------------------------
def _check_env() -> None:
    if not torch.__version__.startswith(EXPECTED_TORCH):
        raise SystemExit(f"expected torch {EXPECTED_TORCH} (CPU), found {torch.__version__}")
    for pkg in ("fla", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            raise SystemExit(
                f"`{pkg}` is importable: transformers would route around its pure-torch "
                "reference path. Use a virtualenv without it."
            )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def _versions() -> dict:
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }


# ------------------------------------------------------------------------------------------------
# forcing / tracing the pure-torch kernels
# ------------------------------------------------------------------------------------------------
class _Trace:
    """Swap the modeling module's kernel globals for their raw torch versions; record calls."""

    def __init__(self, module):
        self.module = module
        self.calls: list[dict] = []
        self._saved = {}

    def __enter__(self):
        mod = self.module
        raw_chunk = getattr(
            mod.torch_chunk_gated_delta_rule, "__wrapped__", mod.torch_chunk_gated_delta_rule
        )
        raw_conv = getattr(mod.causal_conv1d_fn, "__wrapped__", mod.causal_conv1d_fn)
        assert raw_chunk.__module__ == mod.__name__, raw_chunk
        assert raw_conv.__module__ == mod.__name__, raw_conv

        def chunk(query, key, value, g, beta, **kwargs):
            kwargs.pop("cu_seqlens", None)
            out, state = raw_chunk(query, key, value, g=g, beta=beta, **kwargs)
            self.calls.append(
                dict(
                    q=query,
                    k=key,
                    v=value,
                    g=g,
                    beta=beta,
                    core=out,
                    use_l2=kwargs.get("use_qk_l2norm_in_kernel"),
                )
            )
            return out, state

        def recurrent(*args, **kwargs):  # only taken with a cache and T == 1
            raise AssertionError("recurrent path taken")

        for name, fn in (
            ("torch_chunk_gated_delta_rule", chunk),
            ("torch_recurrent_gated_delta_rule", recurrent),
            ("causal_conv1d_fn", raw_conv),
        ):
            self._saved[name] = getattr(mod, name)
            setattr(mod, name, fn)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self.module, name, fn)


# ------------------------------------------------------------------------------------------------
# parameter randomization
# ------------------------------------------------------------------------------------------------
def _randomize(layer, gen) -> None:
    hv = layer.num_v_heads
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name == "A_log":
                # log-uniform spread of decay rates over [0.02, 16], one per stratum, shuffled
                lo, hi = float(np.log(0.02)), float(np.log(16.0))
                edges = torch.linspace(lo, hi, hv + 1, dtype=torch.float64)
                u = torch.rand(hv, generator=gen, dtype=torch.float64)
                vals = edges[:-1] + u * (edges[1:] - edges[:-1])
                p.copy_(vals[torch.randperm(hv, generator=gen)].to(p.dtype))
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "norm.weight":
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name == "conv1d.weight":  # (C, 1, kernel); fan_in = kernel
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
            elif name in ("in_proj_ba.weight", "in_proj_b.weight", "in_proj_a.weight"):
                # b/a pre-activations ~N(0, 0.5^2): beta and the softplus stay in a useful range
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            elif name.endswith(".weight") and p.ndim == 2:  # linear layers: unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            else:
                raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")


# ------------------------------------------------------------------------------------------------
# independent float64 numpy reference of the layer (documents the math)
# ------------------------------------------------------------------------------------------------
def _np_silu(x):
    return x / (1.0 + np.exp(-x))


def _np_softplus(x):
    return np.logaddexp(0.0, x)


def _np_l2norm(x, eps=1e-6):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def _np_layer(sd: dict, cfg: dict, layout: str, x: np.ndarray) -> np.ndarray:
    sd = {k: v.detach().double().numpy() for k, v in sd.items()}
    x = x.astype(np.float64)
    B, T, _ = x.shape
    H, HV = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    K, V = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = HV // H
    if layout == "qwen3_next":
        # grouped per key head: [q (K) | k (K) | v (r*V) | z (r*V)] and [b (r) | a (r)]
        qkvz = (x @ sd["in_proj_qkvz.weight"].T).reshape(B, T, H, 2 * K + 2 * r * V)
        q, k = qkvz[..., :K], qkvz[..., K : 2 * K]
        v = qkvz[..., 2 * K : 2 * K + r * V].reshape(B, T, HV, V)
        z = qkvz[..., 2 * K + r * V :].reshape(B, T, HV, V)
        ba = (x @ sd["in_proj_ba.weight"].T).reshape(B, T, H, 2 * r)
        b, a = ba[..., :r].reshape(B, T, HV), ba[..., r:].reshape(B, T, HV)
        flat = [q.reshape(B, T, H * K), k.reshape(B, T, H * K), v.reshape(B, T, HV * V)]
        mixed = np.concatenate(flat, -1)
    else:
        mixed = x @ sd["in_proj_qkv.weight"].T  # [q (H*K) | k (H*K) | v (HV*V)]
        z = (x @ sd["in_proj_z.weight"].T).reshape(B, T, HV, V)
        b = x @ sd["in_proj_b.weight"].T
        a = x @ sd["in_proj_a.weight"].T
    # depthwise causal conv: y[t, c] = sum_j w[c, j] * x[t - (W-1) + j, c], zero left pad; SiLU
    w = sd["conv1d.weight"][:, 0, :]  # (C, W)
    W = w.shape[1]
    padded = np.concatenate([np.zeros((B, W - 1, mixed.shape[-1])), mixed], 1)
    conv = _np_silu(sum(padded[:, j : j + T, :] * w[:, j] for j in range(W)))
    q = conv[..., : H * K].reshape(B, T, H, K)
    k = conv[..., H * K : 2 * H * K].reshape(B, T, H, K)
    v = conv[..., 2 * H * K :].reshape(B, T, HV, V)
    beta = 1.0 / (1.0 + np.exp(-b))
    g = -np.exp(sd["A_log"]) * _np_softplus(a + sd["dt_bias"])
    # value head j reads key head j // r (repeat_interleave)
    q = _np_l2norm(np.repeat(q, r, axis=2)) * K**-0.5
    k = _np_l2norm(np.repeat(k, r, axis=2))
    S = np.zeros((B, HV, K, V))
    o = np.zeros((B, T, HV, V))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None, None]
        kv = np.einsum("bhk,bhkv->bhv", k[:, t], S)
        delta = beta[:, t, :, None] * (v[:, t] - kv)
        S = S + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    eps = cfg["rms_norm_eps"]
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * sd["norm.weight"] * _np_silu(z)
    return o.reshape(B, T, HV * V) @ sd["out_proj.weight"].T


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ------------------------------------------------------------------------------------------------
# layer fixtures
# ------------------------------------------------------------------------------------------------
def _build_layer(layout: str):
    layer_kw = dict(num_hidden_layers=1, layer_types=["linear_attention"], **TINY)
    if layout == "qwen3_next":
        from transformers.models.qwen3_next import (
            configuration_qwen3_next as cmod,
            modeling_qwen3_next as mmod,
        )

        config = cmod.Qwen3NextConfig(**layer_kw)
        cls = mmod.Qwen3NextGatedDeltaNet
    else:
        from transformers.models.qwen3_5 import (
            configuration_qwen3_5 as cmod,
            modeling_qwen3_5 as mmod,
        )

        config = cmod.Qwen3_5TextConfig(**layer_kw)
        cls = mmod.Qwen3_5GatedDeltaNet
    layer = cls(config, layer_idx=0).to(torch.float32).eval()
    return config, cls, mmod, layer


def make_layer_fixture(layout: str, name: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    config, cls, mmod, layer = _build_layer(layout)
    _randomize(layer, gen)
    sd = {k: v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    HV, V = TINY["linear_num_value_heads"], TINY["linear_value_head_dim"]

    io: dict = {}
    checks: dict = {}
    with torch.no_grad():
        for T in SEQ_LENS:
            x = torch.randn(1, T, TINY["hidden_size"], generator=gen, dtype=torch.float32)
            z_box = {}

            def grab_gate(module, args, output):  # returns None: a value would replace the output
                z_box["z"] = args[1].detach().clone()

            with _Trace(mmod) as tr:
                hook = layer.norm.register_forward_hook(grab_gate)
                out = layer(x)
                hook.remove()
            assert len(tr.calls) == 1, "torch_chunk_gated_delta_rule not called exactly once"
            c = tr.calls[0]
            assert c["use_l2"] is True
            io[f"x_{T}"] = x
            io[f"out_{T}"] = out
            # all intermediates for the short case; only gates and kernel output for the long one
            short = T == SEQ_LENS[0]
            inter = ("q", "k", "v", "g", "beta", "core") if short else ("g", "beta", "core")
            for key in inter:
                io[f"{key}_{T}"] = c[key]
            if short:
                io[f"z_{T}"] = z_box["z"].reshape(1, T, HV, V)

            # cross-checks: float64 numpy re-implementation, and transformers' recurrent kernel
            ref = _np_layer(sd, TINY, layout, x.numpy())
            err_np = checks[f"max_rel_err_vs_numpy_float64_T{T}"] = _rel(out.numpy(), ref)
            rec_fn = mmod.torch_recurrent_gated_delta_rule.__wrapped__
            rec, _ = rec_fn(
                c["q"], c["k"], c["v"], g=c["g"], beta=c["beta"], use_qk_l2norm_in_kernel=True
            )
            err_rec = _rel(c["core"].numpy(), rec.numpy())
            checks[f"max_rel_err_chunk_vs_recurrent_kernel_T{T}"] = err_rec
            assert err_np < 1e-4 and err_rec < 1e-4, checks
            if T > CHUNK:
                # how much does the output after the first chunk depend on the state carried
                # over from it? (skip the W-1 tokens that the conv window also carries over)
                with _Trace(mmod):
                    tail = layer(x[:, CHUNK:])
                start = CHUNK + CONV_W - 1
                checks[f"rel_change_of_out[{start}:]_when_first_chunk_dropped_T{T}"] = _rel(
                    tail[:, CONV_W - 1 :].numpy(), out[:, start:].numpy()
                )

    io = {k: v.detach().to(torch.float32).contiguous() for k, v in io.items()}
    weights = {PREFIX + k: v for k, v in sd.items()}
    # one metadata key only: safetensors writes the metadata map in hash order, so several keys
    # would make the file bytes differ between runs
    producer = "tests/data/make_hf_fixtures.py"
    meta = {
        "producer": f"{producer} transformers={transformers.__version__} torch={torch.__version__}"
    }
    save_file(weights, str(OUT_DIR / f"{name}.safetensors"), metadata=meta)
    save_file(io, str(OUT_DIR / f"{name}_io.safetensors"), metadata=meta)

    desc = dict(
        TINY,
        model_type=config.model_type,
        hf_class=f"{cls.__module__}.{cls.__qualname__}",
        layout=layout,
        weight_prefix=PREFIX,
        weights_file=f"{name}.safetensors",
        io_file=f"{name}_io.safetensors",
        seq_lens=list(SEQ_LENS),
        batch=1,
        dtype="float32",
        seed=seed,
        state_dict={k: list(v.shape) for k, v in weights.items()},
        io={k: list(v.shape) for k, v in io.items()},
        kernel=(
            "torch_chunk_gated_delta_rule(chunk_size=64, use_qk_l2norm_in_kernel=True, "
            "initial_state=None)"
        ),
        checks=checks,
        versions=_versions(),
    )
    (OUT_DIR / f"{name}.json").write_text(json.dumps(desc, indent=2) + "\n")
    return desc


# ------------------------------------------------------------------------------------------------
# kernel fixtures
# ------------------------------------------------------------------------------------------------
def _neg_log_decay(shape, gen):
    """log-decays g in [-1, -0.0067], log-uniformly (a mix of fast and slow forgetting)."""
    return -torch.exp(torch.empty(shape, dtype=torch.float32).uniform_(-5.0, 0.0, generator=gen))


GDN_CONVENTIONS = dict(
    layout=(
        "q,k: (B, T, H, K); v: (B, T, HV, V); g, beta: (B, T, HV); "
        "initial_state, final_state: (B, HV, K, V); out: (B, T, HV, V)"
    ),
    g="natural-log decay per value head and token, <= 0; the state is multiplied by exp(g_t)",
    beta="delta-rule learning rate in (0, 1) per value head and token",
    gva=(
        "if H != HV, q and k are repeat_interleave'd along the head axis: "
        "value head j uses key head j // (HV // H)"
    ),
    l2norm="x * rsqrt(sum(x^2) + 1e-6) on the last axis of q and k, after the float32 cast",
    scale="q is multiplied by K ** -0.5 after the l2norm; the function has no scale argument",
    recurrence=(
        "S = exp(g_t) S; S += k_t (beta_t (v_t - k_t^T S))^T; o_t = (K**-0.5 q_t)^T S  "
        "(S is K x V per head)"
    ),
    dtype="computes in float32; out is cast back to q.dtype, final_state stays float32",
)

KDA_CONVENTIONS = dict(
    layout=(
        "q,k: (B, T, H, K); v: (B, T, H, V); g: (B, T, H, K); beta: (B, T, H); "
        "initial_state, final_state: (B, H, K, V); out: (B, T, H, V)"
    ),
    g="natural-log decay per key channel, <= 0: S = diag(exp(g_t)) S (row i scaled by exp(g_t[i]))",
    heads="no grouped-value support: q, k and v share the same H heads",
    l2norm="x / sqrt(sum(x^2) + 1e-6) on the last axis of q and k, after the float32 cast",
    scale="q is multiplied by K ** -0.5 after the l2norm; the function has no scale argument",
    recurrence="S = diag(exp(g_t)) S; S += k_t (beta_t (v_t - k_t^T S))^T; o_t = (K**-0.5 q_t)^T S",
    dtype="computes in float32; out is cast back to q.dtype, final_state stays float32",
)


def _run_kernel_pair(chunk, recurrent, q, k, v, g, beta, s0):
    kw = dict(g=g, beta=beta, initial_state=s0, output_final_state=True)
    with torch.no_grad():
        out, s_t = chunk(q, k, v, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True, **kw)
        out_r, s_t_r = recurrent(q, k, v, use_qk_l2norm_in_kernel=True, **kw)
    err = max(_rel(out, out_r), _rel(s_t, s_t_r))
    assert err < 1e-4, err
    return out, s_t, err


def make_gdn_kernel_fixture(seed: int) -> dict:
    from transformers.models.qwen3_next import modeling_qwen3_next as mmod

    chunk = mmod.torch_chunk_gated_delta_rule.__wrapped__
    recurrent = mmod.torch_recurrent_gated_delta_rule.__wrapped__
    gen = torch.Generator().manual_seed(seed)
    tensors, cases, checks = {}, {}, {}
    for suffix, (B, T, H, HV, K, V) in {
        "": (1, 50, 2, 2, 16, 8),
        "_gva": (1, 100, 2, 4, 16, 8),
    }.items():
        q = torch.randn(B, T, H, K, generator=gen)
        k = torch.randn(B, T, H, K, generator=gen)
        v = torch.randn(B, T, HV, V, generator=gen)
        g = _neg_log_decay((B, T, HV), gen)
        beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
        s0 = 0.5 * torch.randn(B, HV, K, V, generator=gen)
        out, s_t, err = _run_kernel_pair(chunk, recurrent, q, k, v, g, beta, s0)
        checks[f"max_rel_err_chunk_vs_recurrent{suffix}"] = err
        named = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, out=out, final_state=s_t)
        for n, t in named.items():
            tensors[n + suffix] = t.contiguous()
        cases[suffix] = dict(B=B, T=T, H=H, HV=HV, K=K, V=V)
    save_file(tensors, str(OUT_DIR / "torch_chunk_gdn.safetensors"))
    desc = dict(
        function=f"{chunk.__module__}.{chunk.__qualname__}",
        call=(
            "out, final_state = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, "
            "chunk_size=64, initial_state=initial_state, output_final_state=True, "
            "use_qk_l2norm_in_kernel=True)"
        ),
        cases_by_key_suffix=cases,
        shapes={k: list(v.shape) for k, v in tensors.items()},
        conventions=GDN_CONVENTIONS,
        seed=seed,
        checks=checks,
        versions=_versions(),
    )
    (OUT_DIR / "torch_chunk_gdn.json").write_text(json.dumps(desc, indent=2) + "\n")
    return desc


def make_kda_kernel_fixture(seed: int) -> dict | None:
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as kmod
    except ImportError:
        print("kimi_linear not available in this transformers; skipping the KDA fixture")
        return None
    chunk = kmod.chunk_kimi_delta_attention.__wrapped__
    recurrent = kmod.recurrent_kimi_delta_attention.__wrapped__
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 1, 100, 2, 16, 8
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = _neg_log_decay((B, T, H, K), gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = 0.5 * torch.randn(B, H, K, V, generator=gen)
    out, s_t, err = _run_kernel_pair(chunk, recurrent, q, k, v, g, beta, s0)
    named = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, out=out, final_state=s_t)
    tensors = {n: t.contiguous() for n, t in named.items()}
    save_file(tensors, str(OUT_DIR / "torch_kda.safetensors"))
    desc = dict(
        function=f"{chunk.__module__}.{chunk.__qualname__}",
        call=(
            "out, final_state = chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, "
            "chunk_size=64, initial_state=initial_state, output_final_state=True, "
            "use_qk_l2norm_in_kernel=True)"
        ),
        case=dict(B=B, T=T, H=H, K=K, V=V),
        shapes={k: list(v.shape) for k, v in tensors.items()},
        conventions=KDA_CONVENTIONS,
        seed=seed,
        checks={"max_rel_err_chunk_vs_recurrent": err},
        versions=_versions(),
    )
    (OUT_DIR / "torch_kda.json").write_text(json.dumps(desc, indent=2) + "\n")
    return desc


def main() -> None:
    t0 = time.time()
    _check_env()
    torch.manual_seed(SEED)
    results = {
        "qwen3_next_gdn": make_layer_fixture("qwen3_next", "qwen3_next_gdn", SEED + 1),
        "qwen3_5_gdn": make_layer_fixture("qwen3_5", "qwen3_5_gdn", SEED + 2),
        "torch_chunk_gdn": make_gdn_kernel_fixture(SEED + 3),
        "torch_kda": make_kda_kernel_fixture(SEED + 4),
    }
    for name, desc in results.items():
        if desc is not None:
            print(name, json.dumps(desc["checks"]))
    for p in sorted(OUT_DIR.glob("*.safetensors")):
        size = p.stat().st_size
        assert size < 200_000, (p, size)
        print(f"{p.name}: {size} bytes")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()

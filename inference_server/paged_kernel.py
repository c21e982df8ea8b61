"""The CPU kernels: paged attention (`paged_attention.c`), a prefill's causal attention
(`prefill_attention.c`), the decoder's fused elementwise steps (`fused_ops.c`) and its fp32
projections' matmul (`gemm.c`), built once per machine with its C compiler into one library,
kept in a cache directory, loaded through ctypes. Where there is no compiler, or the build fails, or
`RIPTIDE_PAGED_KERNEL=0`, `decode_kernel()` is None and the paged runner gathers blocks instead
(same results, one more copy of the keys and values a step)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("riptide.paged_kernel")
SOURCES = [Path(__file__).with_name(n) for n in ("paged_attention.c", "prefill_attention.c", "fused_ops.c", "gemm.c")]
HEADERS = [Path(__file__).with_name("exp_neg.h")]       # included by the sources: part of the build's key
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
# With OpenMP the kernels' threads are torch's own OpenMP team: the library's libgomp is the one torch
# loaded (same soname, already in the process). Their own pthreads, made each call, ran beside torch's
# team still spinning after a matmul: a bf16 decode step of 8 rows on both cores took 57.8 ms against 45
# on one. Without OpenMP (another compiler, another runtime in the process) they make their own threads.
OMP_FLAGS = [f for f in FLAGS if f != "-fopenmp-simd"] + ["-fopenmp"]
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("RIPTIDE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "riptide")
    return Path(root) / "kernels"


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "\n".join([platform.machine(), *lines])


def _build(compiler: str, flags: list[str] = FLAGS) -> Path:
    src = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_key().encode() + compiler.encode()).hexdigest()[:16]
    out = _cache_dir() / f"riptide_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:        # built aside, then renamed in
        part = Path(tmp) / out.name
        subprocess.run([compiler, *flags, "-o", str(part), *map(str, SOURCES), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(part, out)
    return out


def _openmp_runtimes() -> set[str]:
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {os.path.realpath(ln.split()[-1]) for ln in maps if "libgomp" in ln or "libiomp" in ln or "libomp" in ln}


def _with_torchs_openmp(compiler: str):
    """The kernels built with OpenMP, if that builds and loading them brings no second OpenMP runtime
    into the process (their libgomp is torch's); else None (the pthread build is used)."""
    if os.environ.get("RIPTIDE_KERNEL_OPENMP", "1") == "0" or "OpenMP" not in torch.__config__.parallel_info():
        return None
    before = _openmp_runtimes()
    try:
        lib = ctypes.CDLL(str(_build(compiler, OMP_FLAGS)))
    except (OSError, subprocess.SubprocessError):
        return None
    if before and _openmp_runtimes() != before:
        log.warning("the OpenMP kernels brought a second OpenMP runtime into the process: using the pthread build")
        return None
    return lib


def _load():
    if os.environ.get("RIPTIDE_PAGED_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("no C compiler: the paged KV cache gathers blocks for attention (slower)")
        return None
    try:
        lib = _with_torchs_openmp(compiler)
        openmp = lib is not None
        lib = lib or ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("paged-attention kernel not built (%s%s): the paged KV cache gathers blocks instead",
                    e, (": " + detail.decode(errors="replace")[-500:]) if detail else "")
        return None
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    signatures = {"paged_decode": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i32, i32, i32, i32, f32, i32],
                  "rms_norm": [ptr, ptr, ptr, ptr, i64, i64, f32, i32],
                  "silu_mul": [ptr, ptr, i64, i64, i32],
                  "rope": [ptr, ptr, ptr, i64, i64, i64, i64, i32]}
    fns = {}
    sample = lib.riptide_sample
    sample.argtypes, sample.restype = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i32], i32
    fns["sample"] = sample
    kv_write = lib.riptide_kv_write
    kv_write.argtypes, kv_write.restype = [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i64, i64, ptr, ptr], i32
    fns["kv_write"] = kv_write
    prefill = lib.riptide_prefill_attention_f32
    prefill.argtypes, prefill.restype = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i32, i32, i32, f32, i32], i32
    fns["prefill_attention"] = prefill
    if openmp:          # built without OpenMP it runs on one thread: oneDNN's then, on torch's team
        sgemm = lib.riptide_sgemm_f32
        sgemm.argtypes, sgemm.restype = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32], i32
        x, w, y = torch.ones(1, 1), torch.ones(64, 1, 1), torch.empty(1, 64)     # built for this CPU (AVX-512)?
        if sgemm(x.data_ptr(), 1, w.data_ptr(), None, y.data_ptr(), 64, 1, 64, 1, 1) == 0:
            fns["sgemm"] = sgemm
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        for name, argtypes in signatures.items():
            fn = getattr(lib, f"riptide_{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, i32
            fns[name, dtype] = fn
    return fns


def _fns():
    with _lock:
        if "fns" not in _loaded:
            _loaded["fns"] = _load()
        return _loaded["fns"]


def decode_kernel(device: torch.device | None = None, dtype: torch.dtype = torch.float32):
    """The loaded kernel function for a cache on `device` in `dtype`, or None (not fp32 or bf16 on a
    CPU, or see the module's docstring). Built at most once a process."""
    if (device is not None and torch.device(device).type != "cpu") or dtype not in (torch.float32, torch.bfloat16):
        return None
    fns = _fns()
    return None if fns is None else fns["paged_decode", dtype]


def cpu_gemm():
    """gemm.c's fp32 matmul (`sgemm`), or None (no compiler, the kernels built without OpenMP,
    RIPTIDE_PAGED_KERNEL=0 or RIPTIDE_CPU_GEMM=0: oneDNN's matmul then)."""
    if os.environ.get("RIPTIDE_CPU_GEMM", "1") == "0":
        return None
    fns = _fns()
    return None if fns is None else fns.get("sgemm")


def kv_writer():
    """paged_attention.c's `riptide_kv_write` (or None: no compiler, RIPTIDE_PAGED_KERNEL=0)."""
    fns = _fns()
    return None if fns is None else fns["kv_write"]


def write_kv(fn, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, base: torch.Tensor, kp: torch.Tensor,
             vp: torch.Tensor) -> bool:
    """Token src[i]'s keys and values (k, v: [tokens, kv_heads, head_dim], rows any stride apart) into
    the pages kp, vp ([blocks, kv_heads, block_size, head_dim], contiguous) at flat row base[i] of KV
    head 0 (head h at base[i] + h * block_size). False where the layouts do not fit (nothing written)."""
    _, kvh, hd = k.shape
    if (k.stride(2) != 1 or k.stride(1) != hd or v.stride(2) != 1 or v.stride(1) != hd or k.dtype != kp.dtype
            or v.dtype != vp.dtype or not (kp.is_contiguous() and vp.is_contiguous()) or kp.shape[1] != kvh):
        return False
    size = k.element_size()
    fn(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, src.data_ptr(), base.data_ptr(), src.numel(),
       kvh, hd * size, kp.shape[2], kp.data_ptr(), vp.data_ptr())
    return True


def prefill_kernel(dtype: torch.dtype):
    """prefill_attention.c's causal attention for `dtype` (fp32 only), or None (another dtype, no
    compiler, RIPTIDE_PAGED_KERNEL=0 or RIPTIDE_PREFILL_KERNEL=0: torch's SDPA then)."""
    if dtype != torch.float32 or os.environ.get("RIPTIDE_PREFILL_KERNEL", "1") == "0":
        return None
    fns = _fns()
    return None if fns is None else fns.get("prefill_attention")


def prefill_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> bool:
    """out = causal attention of q ([n, heads, head_dim]) over k, v ([n, kv_heads, head_dim]), rows
    of each any stride apart (views of the stacked q/k/v projection); False where the kernel was not
    built for the sizes (head_dim 64, up to 4 query heads a KV head, AVX-512): nothing written then."""
    n, heads, hd = q.shape
    kvh = k.shape[1]
    if n == 0 or any(t.stride(2) != 1 or t.stride(1) != hd or t.dtype != torch.float32 for t in (q, k, v, out)):
        return False
    kt = torch.empty(kvh * hd * (-(-n // 16) * 16), dtype=torch.float32)
    return fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
              out.stride(0), kt.data_ptr(), n, kvh, heads // kvh, hd, scale, torch.get_num_threads()) == 0


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] (N a multiple of 64) as gemm.c reads it: [N / 64, K, 64], each 64 outputs' weights
    a contiguous slab."""
    n, k = w.shape
    return w.reshape(n // 64, 64, k).transpose(1, 2).contiguous()


def sgemm(fn, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] fp32 @ W^T (+ bias), W as `pack_panels` gave it: [M, N], or None where the kernel was
    not built for it (the caller falls back). On torch's threads (torch.get_num_threads())."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = panels.shape[0] * 64
    y = torch.empty(m, n, dtype=torch.float32)
    rc = fn(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
            y.data_ptr(), n, m, n, k, torch.get_num_threads())
    return y if rc == 0 else None


class FusedOps:
    """fused_ops.c for tensors of one dtype (fp32 or bf16, CPU, contiguous rows): RMSNorm with the
    residual add before it, SiLU-and-multiply, rotary embedding in place. `threads`: rows dealt to
    that many threads (the caller's torch.get_num_threads())."""

    def __init__(self, fns: dict, dtype: torch.dtype):
        self._norm, self._silu, self._rope = (fns[n, dtype] for n in ("rms_norm", "silu_mul", "rope"))
        self.dtype = dtype

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x) * w; with `residual`, x += residual first (x updated in place). x: [rows, dim]."""
        out = torch.empty_like(x)
        rc = self._norm(x.data_ptr(), None if residual is None else residual.data_ptr(), w.data_ptr(), out.data_ptr(),
                        x.shape[0], x.shape[1], eps, torch.get_num_threads())
        if rc:
            raise ValueError(f"fused rms_norm: dim {x.shape[1]} is more than it takes")
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, gu = [gate | up] by row: [rows, 2 * inter] -> [rows, inter]."""
        inter = gu.shape[1] // 2
        out = gu.new_empty((gu.shape[0], inter))
        self._silu(gu.data_ptr(), out.data_ptr(), gu.shape[0], inter, torch.get_num_threads())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate the first `heads` heads of each row of x ([rows, width]) in place; cos, sin: [rows, head_dim]."""
        rc = self._rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], heads, head_dim,
                        torch.get_num_threads())
        if rc:
            raise ValueError(f"fused rope: head_dim {head_dim} it does not take")


def fused_ops(device: torch.device | None, dtype: torch.dtype) -> FusedOps | None:
    """FusedOps for a CPU model in fp32 or bf16, or None (another device or dtype, no compiler,
    RIPTIDE_PAGED_KERNEL=0 or RIPTIDE_FUSED_OPS=0: torch's ops then)."""
    if (device is not None and torch.device(device).type != "cpu") or dtype not in (torch.float32, torch.bfloat16) \
            or os.environ.get("RIPTIDE_FUSED_OPS", "1") == "0":
        return None
    fns = _fns()
    return None if fns is None else FusedOps(fns, dtype)


class FusedSampler:
    """fused_ops.c's sampler: tokens and logprobs from fp32 logits without the [rows, vocab]
    temporaries of log_softmax, cumsum and searchsorted (a max pass, an exp-sum pass, and a walk to
    the sampled token). Same rule as `Sampler.sample`'s torch path: inverse CDF on u * total, greedy
    rows the first argmax, the logprob of the temperature-scaled distribution."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, logits: torch.Tensor, temps: list[float], u: torch.Tensor | None):
        """(tokens [rows] int64, logprobs [rows], shift [rows] (each row's max), log_total [rows])."""
        rows, vocab = logits.shape
        logits = logits.contiguous()
        t = torch.tensor(temps, dtype=torch.float32)
        if u is not None:
            u = u.to(torch.float32).contiguous()
        tokens = torch.empty(rows, dtype=torch.int64)
        logprobs, shift, log_total = (torch.empty(rows) for _ in range(3))
        self._fn(logits.data_ptr(), rows, vocab, t.data_ptr(), None if u is None else u.data_ptr(),
                 tokens.data_ptr(), logprobs.data_ptr(), shift.data_ptr(), log_total.data_ptr(),
                 torch.get_num_threads())
        return tokens, logprobs, shift, log_total


def fused_sampler(device: torch.device | None) -> FusedSampler | None:
    """The C sampler for logits on a CPU, or None (another device, no compiler, RIPTIDE_PAGED_KERNEL=0
    or RIPTIDE_FUSED_OPS=0: torch's ops then)."""
    if (device is not None and torch.device(device).type != "cpu") or os.environ.get("RIPTIDE_FUSED_OPS", "1") == "0":
        return None
    fns = _fns()
    return None if fns is None else FusedSampler(fns["sample"])


def paged_decode(fn, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, table: torch.Tensor,
                 lens: torch.Tensor, out: torch.Tensor, scale: float, threads: int = 1) -> None:
    """out[r] = attention of q[r] (one token: [heads, head_dim]) over row r's first lens[r] key
    positions, read from pages kp, vp ([blocks, kv_heads, block_size, head_dim]) through
    table[r] (block ids). CPU tensors, the pages fp32 or bf16 (`fn` the kernel for theirs: the
    arithmetic is fp32 either way, a bf16 q and out converted around the call); q and out may be row
    views of larger tensors."""
    rows, heads, head_dim = q.shape
    _, kv_heads, block_size, _ = kp.shape
    wide = out
    if q.dtype != torch.float32:
        q, wide = q.float(), torch.empty(out.shape, dtype=torch.float32)
    elif q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    assert wide.stride(1) == head_dim and wide.stride(2) == 1, "out: rows of [heads, head_dim]"
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in (kp, vp, table, lens))
    assert kp.dtype == vp.dtype and table.dtype == lens.dtype == torch.int64
    rc = fn(q.data_ptr(), q.stride(0), kp.data_ptr(), vp.data_ptr(), table.data_ptr(), table.stride(0),
            lens.data_ptr(), wide.data_ptr(), wide.stride(0), rows, kv_heads, heads // kv_heads, head_dim,
            block_size, scale, threads)
    if wide is not out:
        out.copy_(wide)
    if rc != 0:
        raise ValueError(f"paged-attention kernel: sizes it was not built for (group {heads // kv_heads}, "
                         f"head_dim {head_dim}, block_size {block_size})")

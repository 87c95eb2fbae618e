"""CUDA graphs of Kimi-K3 decode steps on a GPU, in the two forms vLLM captures K3,
each replayed with new values and compared with the same step run eagerly.

    python benchmarks/graph_check.py [--out DIR]   # on the GPU, K3's shapes at TP8
    python benchmarks/graph_check.py --smoke       # on the CPU: the plumbing only

A decode step runs the ops the model class's layers run, without vLLM (none can be
installed on the lent GPU machine): a KDA layer (its projections, the decode step
``kda_decode`` — or with draft tokens ``kda_windows`` — then the gate, norm and
output projection), the attention-residual mix, an MLA decode (``mla_decode`` over
an FP8 paged latent cache) and the latent MoE (``route``, then ``latent_moe`` on
MXFP4 experts). The forms:

- ``full``: one ``torch.cuda.CUDAGraph`` of the whole step, as vLLM's full decode
  graphs hold it (its decorated ops run inside the graph).
- ``breakable``: vLLM's ``BreakableCUDAGraphCapture``, read from vLLM's source as
  ``vllm_baselines`` reads vLLM's kernels, with the KDA delta rule and the MLA
  decode wrapped in its ``eager_break_during_capture`` (as the class's KDA layer and
  vLLM's ``MLAAttention`` are): they run eagerly between graph segments, writing
  into outputs allocated before them.

Each form and case is captured once (the first capture cold: the kernels compile
inside it, as in vLLM's, which warms nothing up), then replayed for several steps
after new values are written into the captured inputs (hidden states, state slots,
longer sequences than at capture, accepted draft counts; after the first, laid out
as vLLM stages fewer requests than the graph holds: a padding row on the null
block, a shorter window, stale token indices); each replay is compared with the
step run eagerly from the same caches (every valid token's output and both KDA
caches but the null block, within 1e-3 of the largest value; the MoE's weighted
sum adds in any order). Shapes are one rank's at TP8 (the MLA output projection
one matrix; 64-token pages; two stored residual blocks). Replay and eager
times per step are reported side by side. ``--smoke`` builds and runs every part on
tiny shapes on the CPU (the kernels on the Triton interpreter): nothing is captured
or replayed there (the report says so); the breakable form runs inside vLLM's
capture with its segments counted instead of captured, its breaks as on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOLERANCE = 1e-3
REPLAYS = 3


@dataclass(frozen=True)
class Shapes:
    """One rank's share of K3 at tensor parallel size 8 (``docs/K3_MODEL.md``)."""

    batch: int = 32
    drafts: int = 0
    hidden: int = 7168
    kda_heads: int = 12  # 96 / 8
    head_dim: int = 128
    conv: int = 4
    mla_heads: int = 12  # 96 / 8
    kv_rank: int = 512
    rope: int = 64
    page: int = 64
    context: int = 4096
    experts: int = 896
    top_k: int = 16
    latent: int = 3584
    inner: int = 384  # 3072 / 8
    banks: int = 2


def cases(smoke: bool) -> list[Shapes]:
    if smoke:
        tiny = dict(hidden=64, kda_heads=2, head_dim=16, mla_heads=4, kv_rank=32,
                    rope=16, page=16, context=40, experts=8, top_k=2, latent=64,
                    inner=32)  # fmt: skip
        return [Shapes(batch=2, **tiny), Shapes(batch=2, drafts=2, **tiny)]
    return [Shapes(batch=1), Shapes(batch=32), Shapes(batch=32, drafts=3)]


class DecodeStep:
    """The static buffers of one decode step and the step itself; ``kda`` and
    ``mla`` are the parts a breakable capture breaks at."""

    def __init__(self, shapes: Shapes, device, seed: int = 0) -> None:
        import torch

        from k3_triton_kernels.moe.naive import ExpertWeights

        self.shapes = s = shapes
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        bf16 = torch.bfloat16
        self.window = s.drafts + 1
        self.tokens = s.batch * self.window
        channels = s.kda_heads * s.head_dim
        self.slot_count = 1 + 2 * s.batch * self.window

        def weight(rows, cols, dtype=bf16):
            return (self.randn(rows, cols) / cols**0.5).to(dtype)

        self.w_qkv = weight(3 * channels, s.hidden)
        self.w_fa, self.w_fb = (
            weight(s.head_dim, s.hidden),
            weight(channels, s.head_dim),
        )
        self.w_b, self.w_g = weight(s.kda_heads, s.hidden), weight(channels, s.hidden)
        self.w_o = weight(s.hidden, channels)
        self.conv_weight = (self.randn(3 * channels, s.conv) / 2).to(bf16)
        self.dt_bias = self.randn(channels)
        self.a_log = self.randn(s.kda_heads) / 2
        self.norm = torch.ones(s.head_dim, device=device)
        self.conv_cache = self.randn(
            self.slot_count, 3 * channels, s.conv - 1 + s.drafts
        ).to(bf16)
        self.recurrent_cache = (
            self.randn(self.slot_count, s.kda_heads, s.head_dim, s.head_dim)
            / s.head_dim**0.5
        )
        self.bank = [self.randn(self.tokens, s.hidden).to(bf16) for _ in range(s.banks)]
        self.mix_norm, self.mix_proj = self.randn(s.hidden), self.randn(s.hidden)
        width = s.kv_rank + s.rope
        self.w_q = weight(s.mla_heads * width, s.hidden)
        self.w_mla_out = weight(s.hidden, s.mla_heads * s.kv_rank)
        pages = -(-2 * s.context // s.page)  # room to grow at replay
        self.kv_cache = self.randn(s.batch * pages, s.page, width).to(self.fp8())
        self.block_table = (
            torch.randperm(s.batch * pages, device=device, generator=self.generator)
            .to(torch.int32)
            .view(s.batch, pages)
        )
        self.seq_lens = torch.full(
            (s.batch,), s.context, dtype=torch.int32, device=device
        )
        self.router = self.randn(s.experts, s.hidden)
        self.router_bias = self.randn(s.experts) / 10
        self.w_down, self.w_up = weight(s.latent, s.hidden), weight(s.hidden, s.latent)

        def packed(*shape):
            return torch.randint(
                0,
                256,
                shape,
                dtype=torch.uint8,
                device=device,
                generator=self.generator,
            )

        def scales(*shape):
            return torch.randint(
                118,
                124,
                shape,
                dtype=torch.uint8,
                device=device,
                generator=self.generator,
            )

        e, i, latent = s.experts, s.inner, s.latent
        self.experts = ExpertWeights(
            packed(e, 2 * i, latent // 2), scales(e, 2 * i, latent // 32),
            packed(e, latent, i // 2), scales(e, latent, i // 32),
        )  # fmt: skip
        self.hidden = self.randn(self.tokens, s.hidden).to(bf16)
        self.slots = torch.zeros(s.batch, self.window, dtype=torch.long, device=device)
        self.skip = torch.zeros(s.batch, dtype=torch.long, device=device)
        self.positions = torch.arange(self.tokens, device=device).view(s.batch, -1)
        self.valid = torch.ones(s.batch, self.window, dtype=torch.bool, device=device)
        self.new_values(context=s.context)

    def randn(self, *shape):
        import torch

        return torch.randn(*shape, generator=self.generator, device=self.device)

    def fp8(self):
        import torch

        hip = torch.version.hip is not None and self.device.type == "cuda"
        return torch.float8_e4m3fnuz if hip else torch.float8_e4m3fn

    def new_values(self, context: int, padded: bool = False) -> None:
        """New values in the captured inputs, in place: hidden states, each row's
        state slots, accepted counts, sequence lengths. ``padded``: laid out as
        vLLM stages a replay of fewer requests than the graph holds — the last row
        a padding row (vLLM's null block 0, no tokens, sequence length 0, stale
        token indices) and, with drafts, the first row a shorter window."""
        import torch

        s = self.shapes
        device, generator = self.device, self.generator
        self.hidden.copy_(self.randn(self.tokens, s.hidden))
        order = torch.randperm(self.slot_count - 1, device=device, generator=generator)
        self.slots.copy_(1 + order[: self.slots.numel()].view_as(self.slots))
        self.skip.copy_(
            torch.randint(
                0, self.window, (s.batch,), device=device, generator=generator
            )
        )
        self.seq_lens.copy_(
            torch.randint(context // 2, context + 1, (s.batch,), device=device,
                          generator=generator)
        )  # fmt: skip
        counts = torch.full((s.batch,), self.window, device=device)
        if padded and s.batch > 1:
            counts[-1] = 0
            self.slots[-1] = 0
            self.skip[-1] = 0
            self.seq_lens[-1] = 0
            if self.window > 1:
                counts[0] = 1 + int(self.window > 2)
        offsets = torch.arange(self.window, device=device)
        self.valid.copy_(offsets < counts[:, None])
        own = torch.arange(self.tokens, device=device).view(s.batch, -1)
        stale = torch.randint(0, self.tokens, own.shape, device=device,
                              generator=generator)  # fmt: skip
        self.positions.copy_(torch.where(self.valid, own, stale))

    def compared(self):
        """The output rows and cache slots a replay must reproduce: every valid
        token's, every slot but vLLM's null block."""
        return self.valid.reshape(-1), slice(1, None)

    def kda(self, qkv, decay, beta, out) -> None:
        """The KDA layer's delta rule into ``out`` ``[tokens, H, D]``."""
        from k3_triton_kernels.kda.decode import kda_decode
        from k3_triton_kernels.kda.windows import kda_windows

        args = (qkv, self.conv_weight, self.conv_cache, decay, self.dt_bias,
                self.a_log, beta, self.recurrent_cache)  # fmt: skip
        if self.shapes.drafts == 0:
            out.copy_(kda_decode(*args, self.slots[:, 0]))
            return
        windows = (self.positions, self.valid, self.slots, self.skip)
        kda_windows(*args, *windows, out=out)

    def mla(self, q, out) -> None:
        """The MLA decode into ``out`` ``[tokens, H, kv_rank]``."""
        from k3_triton_kernels.mla.decode import mla_decode

        s = self.shapes
        o, _ = mla_decode(
            q, self.kv_cache, self.block_table, self.seq_lens, value_dim=s.kv_rank,
            softmax_scale=(s.kv_rank + s.rope) ** -0.5, max_seq_len=2 * s.context,
        )  # fmt: skip
        out.copy_(o.reshape(out.shape))

    def __call__(self, kda, mla):
        import torch

        from k3_triton_kernels.moe.latent_moe import latent_moe
        from vllm_k3_plugin.reference import reference as ref

        s, x = self.shapes, self.hidden
        qkv = x @ self.w_qkv.T
        decay = (x @ self.w_fa.T) @ self.w_fb.T
        beta = torch.sigmoid((x @ self.w_b.T).float())
        core = torch.empty(self.tokens, s.kda_heads, s.head_dim, device=x.device)
        kda(qkv, decay, beta, core)
        gate = torch.sigmoid((x @ self.w_g.T).float())
        normed = ref.rms_norm(core, self.norm, 1e-5).reshape(self.tokens, -1) * gate
        y = normed.to(x.dtype) @ self.w_o.T
        h = ref.attn_res_mix([*self.bank, y], self.mix_norm, self.mix_proj, 1e-5)
        q = (h @ self.w_q.T).view(s.batch, self.window, s.mla_heads, -1)
        attended = torch.empty(self.tokens, s.mla_heads, s.kv_rank, device=x.device)
        mla(q, attended)
        h = attended.to(x.dtype).reshape(self.tokens, -1) @ self.w_mla_out.T
        weights, ids = ref.route(h.float() @ self.router.T, self.router_bias, s.top_k)
        z = h @ self.w_down.T
        routed = latent_moe(z, ids, weights, self.experts, fp8_dtype=self.fp8())
        return routed.to(x.dtype) @ self.w_up.T

    def caches(self):
        return [self.conv_cache, self.recurrent_cache]


def _largest_gap(got, want) -> float:
    """The largest difference over the largest value; infinite where one side is
    not finite and the other is, or the two are not finite alike."""
    import torch

    got, want = got.float(), want.float()
    if not torch.equal(got.isfinite(), want.isfinite()):
        return math.inf
    finite = want.isfinite()
    if not finite.any():
        return 0.0
    peak = float(want[finite].abs().max()) or 1.0
    return float((got[finite] - want[finite]).abs().max()) / peak


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def check_form(form: str, shapes: Shapes, device, *, warm: bool = True) -> dict:
    """Capture ``form`` once, then replay it ``REPLAYS`` times against eager, the
    later replays as vLLM stages fewer requests than the graph holds. ``warm``:
    run the step once before capturing (vLLM does not: with ``warm`` false the
    kernels compile inside the capture, as in a server's first capture)."""
    import torch
    from vllm_baselines import breakable_capture

    capture_class, eager_break = breakable_capture()
    step = DecodeStep(shapes, device)
    on_gpu = device.type == "cuda"
    plain = (step.kda, step.mla)
    broken = (eager_break(step.kda), eager_break(step.mla))
    parts = broken if form == "breakable" else plain
    stream = torch.cuda.Stream() if on_gpu else None
    snapshot = [cache.clone() for cache in step.caches()]

    def restore():
        for cache, saved in zip(step.caches(), snapshot, strict=True):
            cache.copy_(saved)

    graph = capture = None
    if on_gpu:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if warm:
                step(*plain)
                restore()
            if form == "full":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    output = step(*parts)
            else:
                # One memory pool for every segment, as vLLM captures them.
                with capture_class(pool=torch.cuda.graph_pool_handle()) as capture:
                    output = step(*parts)
            # A breakable capture ran its breaks on inputs not yet computed.
            restore()
        torch.cuda.current_stream().wait_stream(stream)
        _synchronize(device)
        replay = graph.replay if graph is not None else capture.replay
    else:
        # No graphs: each "replay" runs the step again, a breakable one inside a
        # capture whose segments are counted, so its breaks run as they would.
        capture = _counted_capture(capture_class) if form == "breakable" else None
        output = None

        def replay():
            nonlocal output
            if capture is None:
                output = step(*parts)
                return
            capture.__init__()
            with capture:
                output = step(*parts)

    if not on_gpu:
        replay()
    result = {"form": form, **asdict(shapes), "replayed": on_gpu, "warm": warm}
    result["gaps"] = []
    if capture is not None:
        result["graphs"], result["breaks"] = (
            capture.num_graphs,
            capture.num_eager_breaks,
        )
    eager_times, replay_times = [], []
    for index in range(REPLAYS):
        context = shapes.context * (index + 2) // 2
        step.new_values(context=context, padded=index > 0)
        rows, slots = step.compared()
        before = [cache.clone() for cache in step.caches()]
        _synchronize(device)
        started = time.perf_counter()
        want = step(*plain)
        _synchronize(device)
        eager_times.append(time.perf_counter() - started)
        want_caches = [cache.clone() for cache in step.caches()]
        for cache, saved in zip(step.caches(), before, strict=True):
            cache.copy_(saved)
        _synchronize(device)
        started = time.perf_counter()
        replay()
        _synchronize(device)
        replay_times.append(time.perf_counter() - started)
        gaps = [_largest_gap(output[rows], want[rows])] + [
            _largest_gap(got[slots], wanted[slots])
            for got, wanted in zip(step.caches(), want_caches, strict=True)
        ]
        result["gaps"].append(max(gaps))
    result["eager_us"] = 1e6 * sorted(eager_times)[REPLAYS // 2]
    result["replay_us"] = 1e6 * sorted(replay_times)[REPLAYS // 2]
    result["ok"] = all(gap <= TOLERANCE for gap in result["gaps"])
    return result


def _counted_capture(capture_class):
    """On the CPU: vLLM's capture with its graph segments counted, not captured
    (no CUDA graph exists there); its eager breaks run as on a GPU."""

    class Counted(capture_class):
        def _begin_segment(self) -> None:
            self._capturing = True

        def _end_segment(self) -> None:
            if self._capturing:
                self._capturing = False
                self._num_graphs += 1

    return Counted()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/k3-graphs"))
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    from k3_triton_kernels import runtime

    rows = []
    failed = False
    with torch.no_grad():
        for index, shapes in enumerate(cases(args.smoke)):
            for form in ("full", "breakable"):
                try:
                    # The first capture compiles the kernels inside it, as vLLM's.
                    warm = index > 0 or form != "full"
                    row = check_form(form, shapes, device, warm=warm)
                except Exception as error:  # report it and go on to the next
                    message = f"{type(error).__name__}: {error}"[:300]
                    row = {**asdict(shapes), "form": form, "ok": False}
                    row["error"] = message
                failed |= not row["ok"]
                rows.append(row)
                print(_line(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    # Which kernels ran, and where a kernel fell back to its PyTorch path, why.
    paths = sorted(f"{kernel}: {line}" for kernel, line in runtime._said)
    print("\n".join(paths))
    report = {"device": name, "tolerance": TOLERANCE, "paths": paths, "rows": rows}
    (out / "graph_check.json").write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


def _line(row: dict) -> str:
    shape = f"B={row['batch']} drafts={row['drafts']}"
    if "error" in row:
        return f"{row['form']:9} {shape}: failed: {row['error']}"
    verdict = "ok" if row["ok"] else "failed"
    parts = [f"{row['form']:9} {shape}: {verdict}, largest gap {max(row['gaps']):.1e}"]
    if "breaks" in row:
        parts.append(f"{row['graphs']} segments, {row['breaks']} breaks")
    if row["replayed"]:
        ratio = row["eager_us"] / row["replay_us"]
        parts.append(
            f"eager {row['eager_us']:.0f} us, replay {row['replay_us']:.0f} us "
            f"({ratio:.2f}x)"
        )
    else:
        parts.append("not captured (CPU): run again against eager")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
